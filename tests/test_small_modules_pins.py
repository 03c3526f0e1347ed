"""Small modules' behaviour the rest of the suite let through when changed by one line (mutation
review, session 58): the JSON-lines logs' torn rows, length traces, the bootstrap's SFT summary, the
REPL's mode / dispatch switches, an infinite reward, rss, the weight check's rotary buffers, the
vLLM stats tap, the weight_sync section's tree shape and buckets, the trainer address's calls.
Each test's docstring names the mutant it kills."""
import json
import zlib
from types import SimpleNamespace

import pytest
import torch

from runtime_helpers import tiny_model  # noqa: F401  (session-wide tiny model folder)
from workers.types import TaskPrompt


def test_a_last_row_that_lost_its_newline_is_dropped_even_when_it_parses(tmp_path):
    """Kills J4 (jsonl_log.drop_rows_from: the ``if not line.endswith("\\n"): continue`` torn
    check removed). A row whose newline was lost parses as JSON; kept, the next append glues the
    re-run row onto it and both are unreadable."""
    from controller.jsonl_log import append_line, drop_rows_from

    p = tmp_path / "iterations.jsonl"
    p.write_text('{"iteration": 0}\n{"iteration": 1}')  # torn just before its newline
    assert drop_rows_from(p, 5) == []
    assert p.read_text() == '{"iteration": 0}\n'
    append_line(p, '{"iteration": 1}')
    assert [json.loads(ln) for ln in p.read_text().splitlines()] == [{"iteration": 0}, {"iteration": 1}]


def _trace(tmp_path, rows):
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_a_length_trace_forces_the_first_answer_of_each_row(tmp_path):
    """Kills L1 (length_trace.forced_lengths: ``r.lengths[0]`` -> ``r.lengths[-1]``): a trace row
    with several answers forces its first (10 words x 1.3 = 13 tokens), not its last (65)."""
    from controller.length_trace import forced_lengths

    f = forced_lengths(_trace(tmp_path, [{"question": "q", "resp_words": [10, 50]}]), 1.0, 1000)
    assert f(TaskPrompt("anything", "", "t")) == 13


def test_a_length_trace_spreads_prompts_of_one_length_over_its_rows(tmp_path):
    """Kills L2 (length_trace.forced_lengths: the row picked by ``len(prompt)`` instead of the
    prompt text's crc32): prompts of one length all got the same forced length."""
    from controller.length_trace import forced_lengths

    rows = [{"question": f"q{i}", "resp_words": [10 * (i + 1)]} for i in range(4)]
    f = forced_lengths(_trace(tmp_path, rows), 1.0, 1000)
    prompts = [f"p{i:02d}" for i in range(40)]  # all three characters long
    got = [f(TaskPrompt(p, "", "t")) for p in prompts]
    assert got == [f(TaskPrompt(p, "", "t")) for p in prompts]  # a prompt always gets the same
    assert got == [[13, 26, 39, 52][zlib.crc32(p.encode()) % 4] for p in prompts]
    assert len(set(got)) > 1


def test_a_built_models_sft_summary_reports_its_last_loss(tmp_path, capsys):
    """Kills B3 (bootstrap.ensure_model: ``"loss_last": sft.losses[-1]`` -> ``sft.losses[0]``):
    the run record's SFT summary said the warm start ended at its first loss."""
    from controller.bootstrap import ensure_model

    init = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 300}
    out = ensure_model(str(tmp_path / "m"), init, "synthetic", {"num_train": 64}, 4, 1e-2, 0)
    said = [ln for ln in capsys.readouterr().err.splitlines() if "SFT loss" in ln][-1]
    first, last = (float(x) for x in said.rsplit("SFT loss ", 1)[1].split(" -> "))
    assert out["sft"]["steps"] == 4 and first != last
    assert round(out["sft"]["loss_first"], 3) == first and round(out["sft"]["loss_last"], 3) == last


def test_repl_mode_switch_refuses_a_mode_of_the_other_placement():
    """Kills S1 (switches.switch_mode: the ``mode.colocated != program.world.colocated`` check
    skipped). A SimpleNamespace program, as tests/test_controller_units.py's switch test: a
    real Program needs a live world."""
    from controller.modes import get_mode
    from controller.switches import switch_mode

    prog = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(max_staleness=4)),
                           world=SimpleNamespace(colocated=False), mode=get_mode("stream"))
    with pytest.raises(ValueError, match="needs a colocated placement"):
        switch_mode(prog, "colocated")
    assert prog.mode.name == "stream"
    prog.world.colocated = True
    with pytest.raises(ValueError, match="needs a disaggregated placement"):
        switch_mode(prog, "stream")
    switch_mode(prog, "colocated")
    assert prog.mode.name == "colocated"


def test_repl_dispatch_switch_names_the_new_dispatcher_on_later_batches():
    """Kills S5 (switches.switch_dispatcher: ``program.dispatch_name = name`` removed): the
    iteration results (Program.step: ``res.dispatch``) named the old dispatcher after the REPL
    switched. SimpleNamespace program (no live instances: the trial plan is skipped)."""
    from controller.switches import switch_dispatcher

    sgs = SimpleNamespace(slots=[], dispatcher=None, seed=0)
    prog = SimpleNamespace(world=SimpleNamespace(sgs=sgs), ranker=object(), dispatch_name="skew")
    switch_dispatcher(prog, "random")
    assert prog.dispatch_name == "random" and sgs.dispatcher is not None


TRAINER_CALLS = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import torch
import torch.distributed.rpc as rpc
from controller.process_state import LOCAL
from controller.trainer_address import TrainerAddress

class Trainer:
    def receive(self, samples):
        if samples == [-1]:
            time.sleep(3.0)
        return len(samples) + 100
    def weights_for(self, version, dtype):
        if version < 0:
            time.sleep(3.0)
        return {{"v": torch.tensor([float(version)]), "dtype": str(dtype)}}

LOCAL.roles["trainer"] = Trainer()
rpc.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
    init_method="tcp://127.0.0.1:{port}", _transports=["uv"], _channels=["basic"]))
out = {{}}
try:
    addr = TrainerAddress.of(TrainerAddress("w0"))  # an address is its own address
    out["of_rref"] = TrainerAddress.of(rpc.RRef(Trainer())).to.name
    got = addr.rpc_async().weights_for(3, "torch.bfloat16").wait()
    out["version"], out["dtype"] = float(got["v"][0]), got["dtype"]
    out["received"] = addr.rpc_async().receive([]).wait()
    t0 = time.time()
    try:
        addr.rpc_async(timeout=0.5).receive([-1]).wait()
        out["timeout"] = "none"
    except RuntimeError as e:
        out["timeout"] = "raised" if time.time() - t0 < 2.5 else "late"
    t0 = time.time()
    try:
        addr.rpc_async(timeout=0.5).weights_for(-1).wait()
        out["timeout_w"] = "none"
    except RuntimeError as e:
        out["timeout_w"] = "raised" if time.time() - t0 < 2.5 else "late"
finally:
    print(json.dumps(out), flush=True)
    rpc.shutdown()
"""


def test_a_trainer_address_calls_its_trainer_with_the_dtype_and_timeout_given():
    """Kills T1 (trainer_address._TrainerCalls.weights_for: ``args=(version, dtype)`` ->
    ``(version, None)``: a joiner's pull in its engine's dtype came back in the trainer's),
    T2 (``TrainerAddress.of`` without its ``isinstance`` branch: an address passed again raised
    AttributeError) and T3 (``receive`` / ``weights_for`` without ``timeout=``: a stuck trainer
    held the instance for rpc's default). Real RPC (one process, its own port) in a subprocess:
    torch's RPC is set up once per process."""
    import os
    import random
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    code = TRAINER_CALLS.format(root=root, port=random.randint(20000, 60000))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, p.stderr[-2000:]
    out = json.loads(lines[-1])
    assert out == {"of_rref": "w0", "version": 3.0, "dtype": "torch.bfloat16", "received": 100,
                   "timeout": "raised", "timeout_w": "raised"}, p.stderr[-2000:]


def test_the_vllm_stats_tap_keeps_the_peak_and_sums_tokens_and_prefix_hits():
    """Kills V1 (vllm_stats.StatsTap.record: ``kv_peak = max(kv_peak, kv_usage)`` ->
    ``kv_usage``), V2 (``prefix_hits += hits`` without ``preempted_hits``) and V3
    (``generated +=`` -> ``=``). vLLM's SchedulerStats / IterationStats as SimpleNamespaces
    (vLLM is not installed where the default suite runs; the tap reads only these fields)."""
    from workers.generation.vllm_stats import StatsTap

    def sched(running, waiting, kv, hits=0, preempted=0):
        return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv,
                               prefix_cache_stats=SimpleNamespace(hits=hits, preempted_hits=preempted))

    tap = StatsTap()
    tap.record(sched(4, 2, 0.75, hits=10, preempted=5), SimpleNamespace(num_generation_tokens=7))
    tap.record(sched(1, 0, 0.25, hits=3), SimpleNamespace(num_generation_tokens=2))
    tap.record(None, SimpleNamespace(num_generation_tokens=1))
    assert (tap.running, tap.waiting, tap.kv_usage) == (1, 0, 0.25)
    assert tap.kv_peak == 0.75 and tap.prefix_hits == 18 and tap.generated == 10


@pytest.mark.parametrize("x, want", [
    (True, None), (False, None), (float("inf"), None), (float("-inf"), None), (float("nan"), None),
    (10 ** 400, None), ("1.0", None), (torch.tensor([0.5]), 0.5), (torch.tensor(2), 2.0), (3, 3.0)])
def test_finite_number_takes_only_finite_reals(x, want):
    """Kills FI1 (finite.finite_number: ``or isinstance(x, bool)`` dropped: a reward of True was
    1.0), FI2 (``math.isfinite`` -> ``not math.isnan``: an infinite reward or admission key
    passed), FI3 (the one-element tensor not unwrapped: a tensor reward was None) and FI4
    (OverflowError not caught: an int 10**400 raised)."""
    from workers.finite import finite_number

    assert finite_number(x) == want


def test_surrogate_at_gives_the_index_of_the_first_lone_surrogate():
    """Kills TC2 (text_check.surrogate_at: ``return e.start`` -> ``e.start + 1``) and TC1
    (``return None``): the row check names the character where the lone surrogate is."""
    from workers.text_check import surrogate_at

    assert surrogate_at("ab\ud800c\udfff") == 2
    assert surrogate_at("\udc00") == 0
    assert surrogate_at("plain é 中") is None


def test_an_engine_device_index_beyond_the_visible_gpus_is_a_config_error(monkeypatch):
    """Kills U1 (generation/support.engine_problem: ``index >= n`` -> ``index > n``) and U4 (the
    device index read as 0): ``engine.device: cuda:1`` on a rank that sees one GPU. The GPU
    count is monkeypatched (``cuda_devices``): the default suite runs without a GPU."""
    from workers.generation import support
    from workers.generation.config import EngineConfig

    monkeypatch.setattr(support, "cuda_devices", lambda: 1)
    said = support.engine_problem(EngineConfig(device="cuda:1"), "rank 1 (generation)")
    assert said == "engine.device: 'cuda:1', but rank 1 (generation) has 1 CUDA device(s)"
    assert support.engine_problem(EngineConfig(device="cuda:3"), "rank 1 (generation)") is not None


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="Linux /proc only")
def test_rss_mb_is_the_resident_set_not_the_address_space():
    """Kills H3 (heap.rss_mb: ``statm``'s field 1 (resident) -> field 0 (VmSize)): the logged
    train/rss_mb_max read the address space, GBs in a torch process, which hid the growth the
    arena cap and trim are there to stop."""
    import os

    from workers import heap

    status = dict(ln.split(":", 1) for ln in open("/proc/self/status").read().splitlines() if ":" in ln)
    rss = int(status["VmRSS"].split()[0]) * 1024 / 1e6
    size = int(status["VmSize"].split()[0]) * 1024 / 1e6
    assert size > 1.5 * rss  # (a torch process maps far more than it holds)
    assert heap.rss_mb() == pytest.approx(rss, rel=0.2)
    assert os.sysconf("SC_PAGE_SIZE") > 0


def test_a_checkpoint_that_saved_its_rotary_buffers_passes_the_weight_check(tmp_path):
    """Kills M5 (model_check.check_weights: the ``"rotary_emb" not in k`` filter on the file's
    tensors dropped): older HF checkpoints carry ``...rotary_emb.inv_freq``, which
    load_pretrained ignores; the check refused such a folder as 'unexpected'."""
    from safetensors.torch import load_file, save_file

    from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained
    from workers.model_check import check_weights

    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    p = tmp_path / "m"
    save_pretrained(init_weights(CausalLM(cfg)), p)
    f = next(p.glob("*.safetensors"))
    tensors = load_file(str(f))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, str(f), metadata={"format": "pt"})
    check_weights(p)  # nothing raised
    tensors["model.layers.0.self_attn.extra.weight"] = torch.ones(4)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected"):
        check_weights(p)


def test_a_weight_sync_section_round_trips_and_its_tree_shape_reaches_the_plan():
    """Kills W4 (weight_sync/config.to_config: ``bucket_bytes / 1e6`` -> ``/ 1e3``: the section
    written back, as the run record and a resumed config read it, was 1000x the bucket), W5
    (``plan``: ``tree_shape`` not passed to plan_sync: every run planned chains) and W6
    (``from_dict``: ``round`` -> ``int``: 0.001001 MB gave 1000 bytes)."""
    from workers.weight_sync.config import WeightSyncConfig
    from workers.weight_sync.plan import TensorSpec

    for sec in ({"bucket_mb": 2.5, "tree_shape": "binary", "naive": False},
                {"bucket_mb": 0.001001, "tree_shape": "chain", "naive": True}):
        cfg = WeightSyncConfig.from_dict(sec)
        assert cfg.to_config() == sec and WeightSyncConfig.from_dict(cfg.to_config()) == cfg
    assert WeightSyncConfig.from_dict({"bucket_mb": 0.001001}).bucket_bytes == 1001
    spec = [TensorSpec("w", (4096,), torch.float32, None)]
    trees = {shape: WeightSyncConfig(bucket_bytes=4096, tree_shape=shape).plan([0], [1, 2, 3, 4, 5], spec).trees
             for shape in ("chain", "star")}
    assert trees["chain"] != trees["star"]
