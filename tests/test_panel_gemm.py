"""The fp32 panel GEMM (workers/generation/panel_gemm.py): the product, its epilogues, the
tails of rows and columns, batch invariance, and bad input. Needs an AVX-512 CPU (and a C++
compiler): skipped elsewhere, where the engine keeps oneDNN's or the plain GEMMs."""
from __future__ import annotations

import pytest
import torch

from workers.generation import panel_gemm

pytestmark = pytest.mark.skipif(not panel_gemm.available(torch.float32),
                                reason="panel GEMMs need an AVX-512 CPU and a C++ compiler")


def _ref(x, w, bias=None, add=None):
    out = x.double() @ w.double().t()
    if bias is not None:
        out += bias.double()
    if add is not None:
        out += add.double()
    return out.float()


@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 97, 200])  # 6-row tiles and every tail; 96-row items
@pytest.mark.parametrize("n,k", [(1, 16), (31, 33), (32, 1), (33, 64), (100, 7), (256, 256)])
def test_equals_the_product_with_bias_and_residual(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    bias, add = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    p = panel_gemm.pack(w)
    assert p.shape == (n, k) and p.data.shape == ((n + 31) // 32, k, 32)
    for b, a in ((None, None), (bias, None), (None, add), (bias, add)):
        got = panel_gemm.linear(x, p, b, a)
        assert got.shape == (m, n) and got.dtype == torch.float32
        # fp32 rounding of a k-term sum, against a float64 reference
        torch.testing.assert_close(got, _ref(x, w, b, a), rtol=1e-5, atol=1e-5 * max(1.0, k ** 0.5))


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads():
    """Every row is computed the same way (one k order, whatever tile or work item holds it):
    bit-for-bit equal alone, at any place in a batch, on one thread or two."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(130, 200, generator=g), torch.randn(300, 200, generator=g)
    p = panel_gemm.pack(w)
    full = panel_gemm.linear(x, p, None)
    for i in (0, 5, 6, 95, 96, 129):
        assert torch.equal(panel_gemm.linear(x[i:i + 1], p, None), full[i:i + 1])
    assert torch.equal(panel_gemm.linear(x[7:20], p, None), full[7:20])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(panel_gemm.linear(x, p, None), full)
    finally:
        torch.set_num_threads(threads)


def test_strided_input_and_packing_a_view():
    """x may be a strided view (the forward hands the attention output reshaped); the weight
    may be a non-contiguous view (a transposed parameter)."""
    g = torch.Generator().manual_seed(1)
    big, wt = torch.randn(9, 80, generator=g), torch.randn(40, 48, generator=g)
    x, w = big[:, ::2], wt.t()  # [9, 40] strided; [48, 40] transposed
    torch.testing.assert_close(panel_gemm.linear(x, panel_gemm.pack(w), None), _ref(x, w), rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_naming_what_is_wrong():
    w = torch.randn(40, 16)
    p = panel_gemm.pack(w)
    with pytest.raises(RuntimeError, match="panel_gemm.pack: the weight must be a 2-D fp32 CPU tensor"):
        panel_gemm.pack(w.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="panel_gemm.pack: the weight must be a 2-D fp32 CPU tensor"):
        panel_gemm.pack(torch.randn(40))
    with pytest.raises(RuntimeError, match=r"panel_gemm.linear: panels \[2, 16, 32\] do not fit x \[3, 15\]"):
        panel_gemm.linear(torch.randn(3, 15), p, None)
    with pytest.raises(RuntimeError, match="panel_gemm.linear: x must be 2-D fp32"):
        panel_gemm.linear(torch.randn(3, 16).double(), p, None)
    with pytest.raises(RuntimeError, match=r"panel_gemm.linear: bias must be fp32 \[40\]"):
        panel_gemm.linear(torch.randn(3, 16), p, torch.randn(39))
    with pytest.raises(RuntimeError, match=r"panel_gemm.linear: add must be fp32 \[3, 40\]"):
        panel_gemm.linear(torch.randn(3, 16), p, None, torch.randn(3, 39))


def test_available_only_for_fp32_on_avx512(monkeypatch):
    assert not panel_gemm.available(torch.bfloat16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not panel_gemm.available(torch.float32)


@pytest.mark.parametrize("m,k,i", [(1, 16, 40), (7, 33, 100), (64, 256, 688), (13, 5, 32)])
def test_swiglu_is_silu_of_the_gate_times_the_up_projection(m, k, i):
    """The SwiGLU in the GEMM's epilogue equals silu(x @ Wg.T + bg) * (x @ Wu.T + bu),
    with and without biases, at a last panel of 8, 4 and 16 columns and a whole one."""
    g = torch.Generator().manual_seed(m + k + i)
    x, wg, wu, b = (torch.randn(*s, generator=g) for s in ((m, k), (i, k), (i, k), (2 * i,)))
    p = panel_gemm.pack_swiglu(wg, wu)
    assert p.gated and p.shape == (2 * i, k)
    for bias in (None, b):
        gate, up = _ref(x, wg, None if bias is None else bias[:i]), _ref(x, wu, None if bias is None else bias[i:])
        want = torch.nn.functional.silu(gate.double()) * up.double()
        got = panel_gemm.swiglu(x, p, bias)
        assert got.shape == (m, i)
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * scale)


def test_swiglu_refuses_panels_that_are_not_a_gate_up_pair():
    x = torch.randn(3, 16)
    with pytest.raises(RuntimeError, match=r"panel_gemm.swiglu: panels \[2, 16, 32\] do not fit"):
        panel_gemm.swiglu(x, panel_gemm.pack(torch.randn(40, 16)), None)  # not a gate/up pair
    p = panel_gemm.pack_swiglu(torch.randn(40, 16), torch.randn(40, 16))
    with pytest.raises(RuntimeError, match=r"panel_gemm.swiglu: bias must be fp32 \[80\]"):
        panel_gemm.swiglu(x, p, torch.randn(40))


@pytest.mark.parametrize("m,k,n", [(1, 16, 40), (7, 33, 100), (64, 256, 512), (100, 48, 64)])
def test_a_folded_rmsnorm_equals_normalising_the_input_first(m, k, n):
    """pack(W, norm=(g, eps)): rms_norm(x, g) @ W.T (+ bias, + residual) with the norm's
    weight in the panels and each row's 1/rms applied in the epilogue; SwiGLU likewise."""
    g = torch.Generator().manual_seed(m * k + n)
    x, w, w2, nw = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n, k), (k,)))
    x = x * 3.0 + 0.5  # rows whose rms is far from 1
    bias, add, eps = torch.randn(n, generator=g), torch.randn(m, n, generator=g), 1e-6
    h = torch.nn.functional.rms_norm(x, (k,), nw, eps)
    p = panel_gemm.pack(w, norm=(nw, eps))
    assert p.rms_eps == eps
    tol = dict(rtol=1e-5, atol=1e-5 * max(1.0, k ** 0.5))
    torch.testing.assert_close(panel_gemm.linear(x, p, bias, add), _ref(h, w, bias, add), **tol)
    ps = panel_gemm.pack_swiglu(w, w2, norm=(nw, eps))
    want = torch.nn.functional.silu(_ref(h, w).double()) * _ref(h, w2).double()
    torch.testing.assert_close(panel_gemm.swiglu(x, ps, None).double(), want, rtol=1e-5,
                               atol=2e-6 * want.abs().max().item())


def test_a_norm_weight_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match=r"a norm weight of shape \(15,\) cannot fold into a weight \[40, 16\]"):
        panel_gemm.pack(torch.randn(40, 16), norm=(torch.ones(15), 1e-6))


def test_a_folded_rmsnorm_with_eps_0():
    from workers.generation import panel_gemm

    if not panel_gemm.available(torch.float32):
        pytest.skip("panel GEMMs need an AVX-512 CPU and a C++ compiler")
    g = torch.Generator().manual_seed(3)
    x, w, nw = torch.randn(7, 16, generator=g) * 3 + 0.5, torch.randn(40, 16, generator=g), torch.randn(16, generator=g)
    h = torch.nn.functional.rms_norm(x, (16,), nw, 0.0)
    got = panel_gemm.linear(x, panel_gemm.pack(w, norm=(nw, 0.0)), None)
    torch.testing.assert_close(got, (h.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-4)
