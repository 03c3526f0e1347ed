"""A generation round's engine numbers reach the iteration's metrics: each instance's report
carries the preemptions of that call and its peak KV use (``GenerationInstance.generate``),
the program sums / maxes them over the batch's instances, and they are logged as
``engine/preemptions`` and ``engine/kv_peak_frac`` (TensorBoard and iterations.jsonl)."""
import json

import torch

from controller.instance import GenerateReport, GenerationInstance
from controller.metrics import Metrics
from controller.batch import IterationResult, engine_stats
from runtime_helpers import LocalRRef, SinkTrainer, tiny_model  # noqa: F401  (tiny_model: session-wide model folder)
from workers.generation.config import EngineConfig
from workers.types import Request, SamplingParams


def _requests(n: int, tokens: int = 8) -> list[Request]:
    """Pairs of samples share a prompt (GRPO-like), ``tokens`` forced."""
    return [Request(i, torch.arange(5 + i // 2) + 3, tokens, tokens, group_id=i // 2,
                    sampling=SamplingParams(temperature=0.0)) for i in range(n)]


def test_a_report_counts_its_own_rounds_preemptions_and_kv_peak(tiny_model):  # noqa: F811
    torch.set_num_threads(1)
    inst = GenerationInstance(1, EngineConfig(device="cpu", kv_cache_tokens=64, block_size=4, max_batch_size=8),
                              tiny_model, [0])
    inst.trainers = [LocalRRef(SinkTrainer())]
    first = inst.generate(0, _requests(8), 0)  # 8 x (5-8 prompt + 8 output) tokens in 16 blocks of 4
    assert first.preemptions == inst.engine.stats().preemptions > 0
    assert first.kv_blocks_peak == first.kv_blocks_total == 16  # full, then preempting
    second = inst.generate(1, [Request(100 + r.sample_id, r.prompt_ids, 4, 4, group_id=50 + r.group_id,
                                       sampling=r.sampling) for r in _requests(2)], 0)
    assert second.preemptions == 0  # the counter is the engine's total; the report is this call's
    # the pair's 5-token prompt: block 0 shared, the partial block 1 copied once on write
    # (the second writer then owns the original): 5 + 3 written tokens each fit in 2 blocks
    assert second.kv_blocks_peak == 3
    assert second.kv_blocks_total == 16


def test_the_batch_sums_preemptions_and_keeps_the_fullest_instance(tmp_path):
    reps = [GenerateReport(1, 0, [0], 8, 1.0, 0, [8], preemptions=3, kv_blocks_peak=16, kv_blocks_total=64),
            GenerateReport(2, 0, [1], 8, 1.0, 0, [8], preemptions=2, kv_blocks_peak=30, kv_blocks_total=40),
            GenerateReport(1, 0, [2], 8, 1.0, 0, [8], preemptions=0, kv_blocks_peak=8, kv_blocks_total=64)]
    assert engine_stats(reps) == {"preemptions": 5.0, "kv_peak_frac": 0.75}
    assert engine_stats([]) == {}  # no round (nothing generated): no engine tags
    m = Metrics(tmp_path, timeline_every=0)
    res = IterationResult(iteration=0, version=1, gen_version=0, metrics={"reward_mean": 0.5}, num_samples=3,
                          num_tokens=24, gen_seconds=1.0, train_seconds=1.0, iter_seconds=2.0, staleness_max=0,
                          interval_s=1.0, engine=engine_stats(reps))
    derived = m.log_iteration(res, [])
    m.close()
    assert derived["engine/preemptions"] == 5.0 and derived["engine/kv_peak_frac"] == 0.75
    row = json.loads((tmp_path / "iterations.jsonl").read_text().splitlines()[0])
    assert row["engine/preemptions"] == 5.0 and row["engine"] == {"preemptions": 5.0, "kv_peak_frac": 0.75}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [round(e.value, 6) for e in ea.Scalars("engine/kv_peak_frac")] == [0.75]
