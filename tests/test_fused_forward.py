"""The engine's FusedForward computes model.py's forward: same hidden states on random Qwen2 /
Llama configs (biases, RoPE scaling, tied head, bf16), and follows in-place weight updates."""
import weakref

import pytest
import torch
from ext_helpers import extension_or_skip

from workers.generation.fused_forward import FusedForward
from workers.model import CausalAttention, CausalLM, ModelConfig, init_weights

torch.set_num_threads(1)

CASES = {
    "qwen2": dict(qkv_bias=True),
    "llama_biases_llama3_rope": dict(
        architecture="LlamaForCausalLM", qkv_bias=True, o_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama_tied_mha": dict(architecture="LlamaForCausalLM", qkv_bias=False, num_key_value_heads=4,
                           tie_word_embeddings=True, head_dim=24),
}


def model_for(case: str, dtype=torch.float32) -> CausalLM:
    kw = dict(vocab_size=61, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    kw.update(CASES[case])
    m = init_weights(CausalLM(ModelConfig(**kw)), seed=3, std=0.1)
    with torch.no_grad():  # non-zero biases and norm weights, so a dropped term would show
        for name, p in m.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return m.eval().to(dtype)


def packed(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return ids, pos, cu


def _cpu_ops_or_skip():
    from workers.generation import cpu_ops

    extension_or_skip(cpu_ops, "C++ fused CPU ops")


# cpu_ops_split: the column-split GEMMs (cpu_ops.linear) the forward takes without prepacked
# weights (engine.cpu_prepack: false, or a CPU without AVX-512): an AVX-512 CPU's default
# forward takes the panel GEMMs and never calls them
OPS = pytest.mark.parametrize("cpu_ops, prepack", [(False, None), (True, None), (True, False)],
                              ids=["torch_ops", "cpu_ops", "cpu_ops_split"])


@OPS
@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_fused_forward_equals_model_forward(case, cpu_ops, prepack):
    if cpu_ops:
        _cpu_ops_or_skip()
    m = model_for(case)
    ids, pos, cu = packed([5, 1, 17, 9], m.config.vocab_size)
    fwd = FusedForward(m, max_len=64, cpu_ops=cpu_ops, prepack=prepack)
    want = m(ids, pos, CausalAttention(cu))
    got = fwd(ids, pos, CausalAttention(cu))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fwd.logits(got), m.logits(want), rtol=1e-5, atol=1e-5)


@OPS
@torch.no_grad()
def test_fused_forward_bf16_close_to_model(cpu_ops, prepack):
    if cpu_ops:
        _cpu_ops_or_skip()
    m = model_for("qwen2", torch.bfloat16)
    ids, pos, cu = packed([6, 11], m.config.vocab_size)
    got = FusedForward(m, max_len=32, cpu_ops=cpu_ops, prepack=prepack)(ids, pos, CausalAttention(cu))
    assert got.dtype == torch.bfloat16
    # two bf16 paths summing in other orders: logits up to ~4 here, where bf16's spacing is 1/64
    # (3 of them: 0.05; with RoPE's frequencies kept fp32 in a cast model, one was 0.035 off)
    torch.testing.assert_close(got.float(), m(ids, pos, CausalAttention(cu)).float(), rtol=3e-2, atol=5e-2)


@torch.no_grad()
def test_fused_weights_follow_in_place_updates():
    m = model_for("qwen2")
    ids, pos, cu = packed([7, 4], m.config.vocab_size)
    fwd = FusedForward(m, max_len=32, prepack=False)  # the plain fused copies (CUDA graphs read them)
    before = fwd(ids, pos, CausalAttention(cu))
    # in-place writes, as an optimizer step or load_weights' copy_ does
    m.model.layers[1].self_attn.k_proj.weight.mul_(-1.5)
    m.model.layers[0].mlp.up_proj.weight.add_(0.05)
    m.model.layers[0].self_attn.q_proj.bias.zero_()
    fused = [t.data_ptr() for layer in fwd.layers for t in layer if t is not None]
    got = fwd(ids, pos, CausalAttention(cu))
    assert not torch.allclose(got, before)
    torch.testing.assert_close(got, m(ids, pos, CausalAttention(cu)), rtol=1e-5, atol=1e-5)
    # the new values went into the same tensors (CUDA graphs keep reading them): epoch unchanged
    assert fwd.epoch == 0 and fused == [t.data_ptr() for layer in fwd.layers for t in layer if t is not None]
    # a parameter replaced by a new object: the tensors are rebuilt, and the epoch says so
    m.model.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(m.model.layers[0].self_attn.o_proj.weight * 2)
    fwd.refresh()
    assert fwd.epoch == 1
    torch.testing.assert_close(fwd(ids, pos, CausalAttention(cu)), m(ids, pos, CausalAttention(cu)),
                               rtol=1e-5, atol=1e-5)


def test_cuda_graph_capture_sizes():
    from workers.generation.cuda_graph import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(100)[-3:] == [64, 96, 100]


@pytest.mark.parametrize("add", ["none", "bias", "residual"])
def test_split_linear_equals_addmm_at_two_threads(add):
    """cpu_ops.linear splits the output columns over the threads (2 here, the benchmark's
    setting; the rest of this file runs at 1 thread, where it is one addmm)."""
    _cpu_ops_or_skip()
    from workers.generation import cpu_ops

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, 96, generator=g), torch.randn(200, 96, generator=g)  # 200: uneven chunks
    extra = {"none": None, "bias": torch.randn(200, generator=g), "residual": torch.randn(64, 200, generator=g)}[add]
    want = x @ w.t() if extra is None else torch.addmm(extra, x, w.t())
    torch.set_num_threads(2)
    try:
        got = cpu_ops.load().linear(x, w, extra)
    finally:
        torch.set_num_threads(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="add must be a bias"):
        cpu_ops.load().linear(x, w, torch.zeros(3))


def test_fused_forward_split_gemms_at_two_threads():
    """Under inference mode at 2 threads, as the engine runs it, with the model's parameters
    requiring grad (as a colocated trainer's do): each worker thread takes the caller's mode."""
    _cpu_ops_or_skip()
    m = model_for("qwen2")
    assert all(p.requires_grad for p in m.parameters())
    ids, pos, cu = packed([5, 1, 17, 9], m.config.vocab_size)
    fwd = FusedForward(m, max_len=64, cpu_ops=True, prepack=False)  # the split GEMMs on every CPU
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():  # as the engine runs it (the worker threads take the caller's mode)
            got = fwd(ids, pos, CausalAttention(cu))
            logits = fwd.logits(got)
    finally:
        torch.set_num_threads(1)
    with torch.no_grad():
        want = m(ids, pos, CausalAttention(cu))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, m.logits(want), rtol=1e-5, atol=1e-5)


def _prepack_or_skip(dtype, packer="auto", monkeypatch=None):
    """Skip unless the forward's packed GEMMs run here for ``dtype``; ``packer`` "onednn"
    hides the panel GEMM (fp32's default), so that oneDNN's fp32 path is the one tested."""
    from workers.generation import panel_gemm, prepacked

    if packer == "onednn":
        monkeypatch.setattr(panel_gemm, "available", lambda dtype: False)
    elif dtype == torch.float32 and panel_gemm.available(dtype):
        return
    if not prepacked.available(dtype):
        pytest.skip(f"oneDNN prepacked GEMMs do not run here for {dtype} (bf16: AVX512-BF16 or AMX)")


@pytest.mark.parametrize("dtype,packer", [(torch.float32, "auto"), (torch.float32, "onednn"), (torch.bfloat16, "auto")],
                         ids=["fp32", "fp32-onednn", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_prepacked_gemms_equal_the_plain_ones(case, dtype, packer, monkeypatch):
    _prepack_or_skip(dtype, packer, monkeypatch)
    m = model_for(case, dtype)
    ids, pos, cu = packed([5, 1, 17, 9], m.config.vocab_size)
    plain, pk = FusedForward(m, max_len=64, prepack=False), FusedForward(m, max_len=64, prepack=True)
    assert pk.prepack and len(pk.packed) == m.config.num_hidden_layers and pk.lm_packed is not None
    want, got = plain(ids, pos, CausalAttention(cu)), pk(ids, pos, CausalAttention(cu))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(pk.logits(got).float(), plain.logits(want).float(), rtol=tol, atol=tol)


@torch.no_grad()
def test_prepacked_weights_follow_in_place_updates_of_every_gemm():
    """The packed copies are of o_proj, down_proj and lm_head too, which the plain forward
    reads from the model directly: an in-place write to any of them (load_weights' copy_,
    a colocated optimizer step) must reach the next forward."""
    _prepack_or_skip(torch.float32)
    m = model_for("llama_tied_mha")  # tied: lm_head is the embedding
    ids, pos, cu = packed([7, 4], m.config.vocab_size)
    fwd = FusedForward(m, max_len=32, prepack=True)
    before = fwd.logits(fwd(ids, pos, CausalAttention(cu)))
    m.model.layers[0].self_attn.o_proj.weight.mul_(0.5)
    m.model.layers[1].mlp.down_proj.weight.add_(0.05)
    m.model.embed_tokens.weight.mul_(-1.0)
    got = fwd.logits(fwd(ids, pos, CausalAttention(cu)))
    assert not torch.allclose(got, before)
    torch.testing.assert_close(got, m.logits(m(ids, pos, CausalAttention(cu))), rtol=1e-5, atol=1e-5)
    # and the fused ones, packed from the model's q/k/v and gate/up parameters
    m.model.layers[1].self_attn.k_proj.weight.mul_(-1.5)
    m.model.layers[0].mlp.up_proj.weight.add_(0.05)
    again = fwd.logits(fwd(ids, pos, CausalAttention(cu)))
    assert not torch.allclose(again, got)
    torch.testing.assert_close(again, m.logits(m(ids, pos, CausalAttention(cu))), rtol=1e-5, atol=1e-5)
    # and the RMSNorm weights (folded into the q/k/v and gate/up panels on fp32 AVX-512 CPUs)
    m.model.layers[0].input_layernorm.weight.mul_(1.5)
    m.model.layers[1].post_attention_layernorm.weight.add_(0.1)
    third = fwd.logits(fwd(ids, pos, CausalAttention(cu)))
    assert not torch.allclose(third, again)
    torch.testing.assert_close(third, m.logits(m(ids, pos, CausalAttention(cu))), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_prepacking_keeps_no_plain_fused_copies():
    """With prepacked GEMMs the forward reads only the packed q/k/v and gate/up weights: the
    plain fused copies are not kept beside them (for Qwen2.5-7B in bf16, 8.5 GB). What the
    forward holds beyond the model is one packed copy of each GEMM's weights (and the small
    fused biases, RoPE table)."""
    _prepack_or_skip(torch.float32)
    m = model_for("qwen2")  # untied, q/k/v biases
    fwd = FusedForward(m, max_len=32, prepack=True)
    assert all(layer[1] is None and layer[6] is None for layer in fwd.layers)
    assert all(layer[2] is not None for layer in fwd.layers)  # the fused q/k/v bias stays

    c = m.config
    d, nq, nkv = c.hidden_size, c.num_attention_heads * c.dim_head, c.num_key_value_heads * c.dim_head
    assert [tuple(t.shape) for t in fwd.packed[0]] == [(nq + 2 * nkv, d), (d, nq), (2 * c.intermediate_size, d),
                                                         (d, c.intermediate_size)]
    from workers.generation import panel_gemm

    if fwd.gemm is panel_gemm:  # fp32 on an AVX-512 CPU: the panel layout
        assert all(isinstance(t, panel_gemm.Panels) for layer in fwd.packed for t in layer)
    else:
        assert all(t.is_mkldnn for layer in fwd.packed for t in layer)  # oneDNN's own copies
    # beside the model's parameters the forward keeps only small plain tensors (biases, norms)
    params = {p.data_ptr() for p in m.parameters()}
    extra = sum(t.numel() for layer in fwd.layers for t in layer if t is not None and t.data_ptr() not in params)
    assert extra == c.num_hidden_layers * (nq + 2 * nkv)  # the fused q/k/v biases


def test_prepack_where_it_cannot_run_is_refused_and_auto_falls_back(monkeypatch):
    from workers.generation import panel_gemm, prepacked

    m = model_for("qwen2")
    monkeypatch.setattr(panel_gemm, "available", lambda dtype: False)
    monkeypatch.setattr(prepacked, "available", lambda dtype: False)
    with pytest.raises(ValueError, match=r"prepacked GEMMs do not run here for torch.float32 on cpu"):
        FusedForward(m, max_len=32, prepack=True)
    fwd = FusedForward(m, max_len=32)  # auto: the plain GEMMs
    assert not fwd.prepack and fwd.packed == [] and fwd.lm_packed is None


def test_prepacked_probe_says_no_when_onednn_fails(monkeypatch):
    from workers.generation import prepacked

    def broken(weight, batch_hint):  # as a torch build or CPU without the kernel raises
        raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx512bw, avx512vl and avx512dq")

    monkeypatch.setattr(prepacked, "pack", broken)
    prepacked.available.cache_clear()
    try:
        assert prepacked.available(torch.bfloat16) is False
    finally:
        prepacked.available.cache_clear()


@pytest.mark.parametrize("capability, on", [("AVX2", False), ("AVX512", True)])
def test_prepack_by_default_only_on_avx512_cpus(monkeypatch, capability, on):
    # measured faster there; on AVX2 (oneDNN held to it) fp32 was 6% slower at small shapes
    from workers.generation import prepacked

    monkeypatch.setattr(prepacked, "available", lambda dtype: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert FusedForward(model_for("qwen2"), max_len=32).prepack is on


@torch.no_grad()
def test_repacking_after_a_weight_update_drops_the_old_packed_copies_first(monkeypatch):
    """A weight update (every RL step) re-packs every GEMM weight: the old packed copies are
    released before the new ones are made, so memory never holds two sets (measured at 0.5B
    bf16: the refresh's peak was +1,057 MiB over the resting RSS with both, +0 now)."""
    _prepack_or_skip(torch.float32)
    m = model_for("qwen2")
    fwd = FusedForward(m, max_len=32, prepack=True)
    old = [weakref.ref(t) for layer in fwd.packed for t in layer] + [weakref.ref(fwd.lm_packed)]
    alive = []  # old packed copies still alive at each pack call
    def counting(f):
        return lambda *a, **k: (alive.append(sum(r() is not None for r in old)), f(*a, **k))[1]

    monkeypatch.setattr(fwd.gemm, "pack", counting(fwd.gemm.pack))  # fp32 on AVX-512: panel_gemm
    if hasattr(fwd.gemm, "pack_swiglu"):  # gate/up packed in one call
        monkeypatch.setattr(fwd.gemm, "pack_swiglu", counting(fwd.gemm.pack_swiglu))
    m.model.layers[0].mlp.up_proj.weight.add_(0.01)
    fwd.sync()
    assert len(alive) == 4 * m.config.num_hidden_layers + 1 and max(alive) == 0
    assert len(fwd.packed) == m.config.num_hidden_layers and fwd.lm_packed is not None
