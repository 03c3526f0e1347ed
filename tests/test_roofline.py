"""bench/roofline.py: the byte and step counts of a decode workload, checked against the K/V rows
the native engine's attention really reads, and the floors computed from them."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from ext_helpers import extension_or_skip

from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.model import CausalLM, ModelConfig, init_weights
from workers.types import Request, SamplingParams

torch.set_num_threads(1)
BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def roofline():
    spec = importlib.util.spec_from_file_location("bench_roofline", BENCH / "roofline.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _work(lengths_and_new, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, CFG.vocab_size, (p,), generator=g), n) for p, n in lengths_and_new]


@pytest.mark.parametrize("batch", [8, 3])
def test_counts_match_the_rows_the_engines_attention_reads(roofline, monkeypatch, batch):
    """The decode K/V rows (sum over decode steps and sequences of the context length) and the
    decode step count, against the C++ attention kernel's own calls in a real engine run:
    equal rows; equal steps when the batch holds every sequence, more (never fewer) when
    sequences wait for a slot."""
    from workers.generation import cpu_attention

    extension_or_skip(cpu_attention, "C++ CPU attention kernel")
    calls = []
    real = cpu_attention.paged_attention

    def counting(q, k_cache, v_cache, block_tables, seq_of, positions, scale):
        # a decode token is its sequence's only one in the call (prompts of >= 2 tokens: a prefill
        # repeats its sequence); a mixed step (decodes and an admission in one call) has both
        seqs = seq_of.tolist()
        lone = torch.tensor([seqs.count(x) == 1 for x in seqs])
        calls.append((bool(lone.any()), int((positions[lone] + 1).sum())))
        return real(q, k_cache, v_cache, block_tables, seq_of, positions, scale)

    monkeypatch.setattr(cpu_attention, "paged_attention", counting)
    work = _work([(2, 9), (7, 1), (5, 14), (12, 3), (3, 6)])
    eng = NativeEngine(EngineConfig(block_size=4, kv_cache_tokens=1024, max_batch_size=batch,
                                    attention_backend="cpu"),
                       model=init_weights(CausalLM(CFG), seed=0).eval())
    sp = SamplingParams(temperature=1.0)
    generate_all(eng, [Request(sample_id=i, prompt_ids=p, max_tokens=n, min_tokens=n, sampling=sp)
                       for i, (p, n) in enumerate(work)])

    layers = CFG.num_hidden_layers
    rows = sum(r for d, r in calls if d) // layers
    steps = sum(d for d, _ in calls) // layers
    row_bytes = 2 * layers * CFG.num_key_value_heads * CFG.dim_head * 4
    kv, w = roofline.decode_bytes(CFG, work, batch, weight_bytes=4, kv_bytes=4)
    assert kv == rows * row_bytes
    assert steps >= roofline.decode_steps(work, batch)
    if batch >= len(work):
        assert steps == roofline.decode_steps(work, batch) == 13
    assert w == roofline.matmul_params(CFG) * 4 * roofline.decode_steps(work, batch)


def test_floors_by_hand(roofline):
    """One prompt of 3 tokens, 4 new: decode queries at positions 3, 4, 5 read 4 + 5 + 6 rows;
    3 steps of weights; floors from the two rates."""
    work = _work([(3, 4)])
    kv, w = roofline.decode_bytes(CFG, work, 1, weight_bytes=2, kv_bytes=4)
    row = 2 * 3 * 2 * 16 * 4  # K and V, 3 layers, 2 KV heads, head size 16, fp32
    assert kv == 15 * row
    params = 3 * (64 * 16 * (4 * 2 + 2 * 2) + 3 * 64 * 96) + 64 * 97
    assert roofline.matmul_params(CFG) == params and w == params * 2 * 3
    f = roofline.roofline(CFG, work, 1, torch.bfloat16, torch.float32, flops_per_s=1e9, bytes_per_s=1e8)
    assert f.tokens == 4 and f.kv_bytes == kv and f.weight_bytes == w
    assert f.compute_s == pytest.approx(roofline.model_flops(CFG, work) / 1e9)
    assert f.memory_s == pytest.approx((kv + w) / 1e8)
    assert f.serial_s == pytest.approx(f.compute_s + f.memory_s)
    assert f.overlap_s == max(f.compute_s, f.memory_s)
    assert f.overlap_tok_s == pytest.approx(4 / f.overlap_s) and f.serial_tok_s < f.overlap_tok_s


def test_one_token_samples_decode_nothing(roofline):
    work = _work([(5, 1), (9, 1)])
    assert roofline.decode_steps(work, 4) == 0
    assert roofline.decode_bytes(CFG, work, 4, 4, 4) == (0.0, 0.0)


def test_steps_lower_bound_spreads_tokens_over_full_batches(roofline):
    work = _work([(2, 11)] + [(2, 3)] * 10)  # 10 + 10 x 2 = 30 decode tokens
    assert roofline.decode_steps(work, 64) == 10
    assert roofline.decode_steps(work, 2) == 15


def test_rates_must_be_positive(roofline):
    with pytest.raises(ValueError, match="rates must be positive"):
        roofline.roofline(CFG, _work([(3, 4)]), 1, torch.float32, torch.float32, 0.0, 1e9)


def test_probes_measure_something(roofline):
    now, sync = __import__("time").perf_counter, lambda: None
    assert roofline.read_bandwidth("cpu", now, sync, mib=8, seconds=0.05) > 1e8
    assert roofline.matmul_flops("cpu", now, sync, n=64, seconds=0.05) > 1e6
    assert roofline.matmul_flops("cpu", now, sync, n=64, seconds=0.05, dtype=torch.bfloat16) > 1e6
