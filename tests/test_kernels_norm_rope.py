"""Fused RMSNorm and rotary Triton kernels vs their torch references and vs workers.model.
CPU: triton's interpreter (TRITON_INTERPRET=1 set before triton is imported); CUDA: compiled."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
pytest.importorskip("triton", reason="triton not installed (pip install streamrl[kernels])")

import kernels  # noqa: E402
from kernels.norm_rope import rms_norm, rms_norm_ref, rotary, rotary_ref  # noqa: E402
from workers.model import ModelConfig, RMSNorm, RotaryEmbedding, apply_rotary  # noqa: E402

pytestmark = pytest.mark.triton
if kernels.interpreter_mismatch():
    pytest.skip(kernels.interpreter_mismatch(), allow_module_level=True)
DEVICE = "cpu" if kernels.interpreting() else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one rounding (kernel) vs several (eager torch) in 16-bit: allow a couple of ulps
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,dim", [(5, 64), (3, 896), (2, 100)])
def test_rms_norm(rows, dim, dtype):
    x, res = rand(rows, dim, dtype=dtype), rand(rows, dim, dtype=dtype, seed=1)
    w = (1 + 0.1 * rand(dim, dtype=torch.float32, seed=2)).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **TOL[dtype])
    out, h = rms_norm(x, w, 1e-6, residual=res)
    ref_out, ref_h = rms_norm_ref(x, w, 1e-6, residual=res)
    # one rounding of x + res both ways; the interpreter's bf16 rounding is not IEEE
    # round-to-nearest-even (ties and mantissa carries differ): allow 1 ulp there
    exact = dict(atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 and kernels.interpreting() else 0)
    torch.testing.assert_close(h, ref_h, **exact)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


def test_a_16bit_row_by_an_fp32_weight_promotes_as_the_reference():
    """A norm weight kept in fp32 over bf16 rows: fp32 out, as the reference (and torch's
    promotion) gives, not rounded back to the rows' dtype."""
    x, w = rand(3, 100, dtype=torch.bfloat16), 1 + 0.1 * rand(100, dtype=torch.float32, seed=2)
    got, want = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])  # the bf16 rounding of the normalised row


def test_rms_norm_ref_is_the_model_layer():
    layer = RMSNorm(64, 1e-6).to(DEVICE)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    x = rand(4, 64, dtype=torch.float32)
    torch.testing.assert_close(rms_norm(x, layer.weight.detach(), 1e-6), layer(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rms_norm_ref(x, layer.weight, 1e-6), layer(x), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,heads,head_dim", [(3, 4, 64), (2, 14, 128), (4, 2, 16), (2, 3, 80)])
def test_rotary(tokens, heads, head_dim, dtype):
    x = rand(tokens, heads, head_dim, dtype=dtype)
    cfg = ModelConfig(vocab_size=8, hidden_size=heads * head_dim, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=4096)
    rope = RotaryEmbedding(cfg).to(DEVICE)
    cos, sin = rope(torch.tensor([0, 7, 1000, 4095][:tokens], device=DEVICE), dtype)  # [T, 1, Dh]
    model_out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(rotary_ref(x, cos[:, 0], sin[:, 0]), model_out, atol=0, rtol=0)
    torch.testing.assert_close(rotary(x, cos[:, 0], sin[:, 0]), model_out, **TOL[dtype])


def test_bad_shapes_are_named():
    x = rand(3, 4, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="cos"):
        rotary(x, x[:, 0, :32], x[:, 0])
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x[:, 0], x[0, 0, :10], 1e-6)
    # read as contiguous / as x's dtype by the kernels: refused, not a silently different answer
    with pytest.raises(ValueError, match=r"weight must be contiguous, got stride \(2,\)"):
        rms_norm(x[:, 0], rand(128, dtype=torch.float32)[::2], 1e-6)
    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm(x[:, 0].bfloat16(), x[0, 0].bfloat16(), 1e-6, residual=x[:, 0])
    with pytest.raises(ValueError, match="cos must be .* in x's dtype torch.bfloat16"):
        rotary(x.bfloat16(), x[:, 0], x[:, 0].bfloat16())
