"""kv_cache_dtype (as vLLM's): an fp32 model with a bf16/fp16 K/V cache. The config key is
validated; the cache really is 16-bit (half the bytes); greedy output stays close to the fp32
cache's (same tokens nearly everywhere, log-probs within bf16 rounding) on both attention
backends that support it; "auto" is unchanged (test_engine.py's exactness tests)."""
import pytest
import torch
from ext_helpers import extension_or_skip
from test_engine import PS, engine, greedy_requests, tiny_model

from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all

torch.set_num_threads(1)


def test_config_key_validated():
    with pytest.raises(ValueError, match=r"engine.kv_cache_dtype: must be one of .*'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"engine.kv_cache_dtype: must be 'auto' with attention_backend 'triton'"):
        EngineConfig(kv_cache_dtype="bfloat16", attention_backend="triton")
    assert EngineConfig().kv_cache_dtype == "auto"


def test_16bit_cache_needs_an_fp32_model():
    with pytest.raises(ValueError, match="engine.kv_cache_dtype: 'float16' needs an fp32 model"):
        NativeEngine(EngineConfig(block_size=4, kv_cache_tokens=64, kv_cache_dtype="float16"),
                     model=tiny_model().to(torch.bfloat16))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_bf16_cache_close_to_fp32_cache(backend):
    if backend == "cpu":
        from workers.generation import cpu_attention

        extension_or_skip(cpu_attention, "C++ CPU attention kernel")
    reqs = greedy_requests(PS, 14)
    ref_eng = engine(attention_backend=backend)
    eng = engine(attention_backend=backend, kv_cache_dtype="bfloat16")
    assert eng.runner.cache.k[0].dtype == torch.bfloat16
    assert eng.runner.cache.nbytes() * 2 == ref_eng.runner.cache.nbytes()
    ref, got = generate_all(ref_eng, reqs), generate_all(eng, reqs)
    same = total = 0
    for r, g in zip(ref, got):
        a, b = r.output_ids.tolist(), g.output_ids.tolist()
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))  # first divergence
        same, total = same + n, total + len(a)
        # up to the first divergence both decode the same sequence: log-probs within bf16
        # rounding; at the divergence the two picks are a near tie (equal log-probs too)
        torch.testing.assert_close(g.logprobs[:n + 1], r.logprobs[:n + 1], rtol=0, atol=0.05)
    # this random model's distributions are flat (near ties): 80 of 112 tokens precede a
    # divergence on either backend
    assert same / total >= 0.6, f"only {same}/{total} tokens before divergence"
