"""Triton paged decode attention vs the torch reference.

On CPU the kernels run in triton's interpreter: TRITON_INTERPRET=1 is set here, before any
triton kernel is defined (kernels/ imports triton lazily, so module import order does not
matter; ``test_interpret_env_after_kernels_import`` checks that). On a CUDA machine
(bench/gpu_check.sh) the same cases run compiled on the GPU.

The interpreter costs ~50 ms per (program, tile), so the cases are a covering set, not a
cross-product: every head dim, block size, GQA ratio, dtype and length class appears, and the
long contexts use few KV heads.
"""
import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
pytest.importorskip("triton", reason="triton not installed (pip install streamrl[kernels])")

import kernels  # noqa: E402
from kernels.paged_decode import (DecodeLaunch, check_inputs, choose_launch, paged_decode_attention,  # noqa: E402
                                  paged_decode_attention_ref)

pytestmark = pytest.mark.triton
if kernels.interpreter_mismatch():  # another module imported triton before we could set it
    pytest.skip(kernels.interpreter_mismatch(), allow_module_level=True)
DEVICE = "cpu" if kernels.interpreting() else "cuda"
# FlagGems-style per-dtype tolerances: kernel output (in dtype) vs an fp32 reference computed
# from the same (dtype-rounded) inputs.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5),
       torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=8e-3, rtol=1.6e-2)}


def make_paged(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random q and a paged cache holding sequences of ``lens`` tokens in shuffled blocks.
    Everything a correct kernel must not read is NaN: spare blocks, slots past each sequence's
    end and block 0 (what unused block-table entries point at)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in lens]
    max_blocks = max(max(nblk), 1) + 1  # one always-unused column
    num_blocks = 1 + sum(nblk) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).int()
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        tables[b, :nblk[b]] = ids[used:used + nblk[b]]
        used += nblk[b]
        kv = torch.randn(2, nblk[b] * block_size, num_kv_heads, head_dim, generator=g)
        kv[:, n:] = float("nan")
        for i in range(nblk[b]):
            rows = slice(i * block_size, (i + 1) * block_size)
            k[tables[b, i]], v[tables[b, i]] = kv[0, rows], kv[1, rows]
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), tables, lens_t)]


def check(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits=None):
    q, k, v, tables, lens_t = make_paged(lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k, v, tables, lens_t, scale, num_splits=num_splits)
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, lens_t, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    return out, ref


# (lens, H, Hkv, head_dim, block_size, dtype, num_splits); GQA ratio = H / Hkv
SHORT_CASES = [
    ([1], 4, 4, 64, 16, torch.float32, None),                  # one token, MHA
    ([1, 45, 33], 8, 4, 128, 32, torch.float16, None),         # GQA 2, ragged
    ([17, 100], 8, 2, 64, 32, torch.bfloat16, 1),              # GQA 4
    ([31, 64, 129], 16, 2, 128, 16, torch.float32, 2),         # GQA 8, split short seqs
    ([1, 16, 47], 8, 1, 64, 16, torch.bfloat16, 8),            # GQA 8, splits past the end
    ([70], 32, 1, 128, 32, torch.float16, None),               # GQA 32 (group > 16)
    ([33, 2], 14, 2, 64, 16, torch.float16, None),             # GQA 7 (Qwen2.5-0.5B heads)
    ([5, 40], 6, 3, 80, 16, torch.float32, 3),                 # head_dim not a power of 2
    ([9, 23], 4, 2, 8, 16, torch.bfloat16, None),              # tiny head_dim (test models)
]
LONG_CASES = [  # several thousand tokens, split-K
    ([3000, 7], 4, 1, 64, 16, torch.bfloat16, None),           # GQA 4, auto splits
    ([4100], 8, 1, 128, 32, torch.float16, 5),                 # GQA 8
    ([2500], 2, 1, 64, 32, torch.float32, 3),                  # GQA 2
    ([2049], 1, 1, 128, 16, torch.bfloat16, 4),                # GQA 1
]


@pytest.mark.parametrize("case", SHORT_CASES + LONG_CASES, ids=lambda c: (
    f"L{'-'.join(map(str, c[0]))}_H{c[1]}kv{c[2]}_D{c[3]}_bs{c[4]}_{str(c[5])[6:]}_s{c[6]}"))
def test_matches_reference(case):
    check(*case)


@pytest.mark.skipif(DEVICE != "cuda", reason="full cross-product only compiled on CUDA "
                    "(the interpreter runs the covering set above)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_cross_product(head_dim, block_size, gqa, dtype):
    check([1, 17, 300, 4099], 2 * gqa, 2, head_dim, block_size, dtype)


def test_split_count_does_not_change_result():
    q, k, v, tables, lens_t = make_paged([300, 130], 4, 1, 64, 16, torch.float32)
    outs = [paged_decode_attention(q, k, v, tables, lens_t, 0.1, num_splits=s) for s in (1, 3)]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=1e-5)


def test_pieces_follow_each_length_in_a_wide_table():
    """Each sequence's own context is cut into the splits, whatever the block table's width
    (the engine's CUDA graphs pass tables sized for max_model_len): ragged lengths in a table
    16x wider than they need, automatic and explicit split counts."""
    q, k, v, tables, lens_t = make_paged([1, 130, 257, 700], 8, 2, 64, 16, torch.float32)
    wide = torch.zeros(4, tables.shape[1] * 16, dtype=torch.int32, device=DEVICE)
    wide[:, :tables.shape[1]] = tables
    ref = paged_decode_attention_ref(q, k, v, tables, lens_t, 0.125)
    for splits in (None, 2, 7):
        out = paged_decode_attention(q, k, v, wide, lens_t, 0.125, num_splits=splits)
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_empty_sequence_gives_zeros():
    q, k, v, tables, lens_t = make_paged([0, 20], 4, 2, 64, 16, torch.float32)
    for splits in (1, 2):
        out = paged_decode_attention(q, k, v, tables, lens_t, 0.125, num_splits=splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out[1]).all()


def test_reference_matches_dense_sdpa():
    """The reference itself vs torch SDPA on the gathered dense cache (GQA via enable_gqa)."""
    q, k, v, tables, lens_t = make_paged([37], 8, 2, 64, 16, torch.float32)
    blocks = tables[0, :3].long()
    kd = k[blocks].reshape(-1, 2, 64)[:37].transpose(0, 1)[None]  # [1, Hkv, 37, Dh]
    vd = v[blocks].reshape(-1, 2, 64)[:37].transpose(0, 1)[None]
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], kd, vd, scale=0.125, enable_gqa=True)[:, :, 0]
    ref = paged_decode_attention_ref(q, k, v, tables, lens_t, 0.125)
    torch.testing.assert_close(ref, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 1, 128), (64, 2, 8), (6, 3, 80)])
def test_launch_shapes_are_gpu_compilable(heads, kv_heads, head_dim):
    """Every tl.dot operand dim >= 16 whatever the model shape (DecodeLaunch validates)."""
    q = torch.empty(3, heads, head_dim)
    cache = torch.empty(10, 16, kv_heads, head_dim)
    cfg = choose_launch(q, cache, torch.empty(3, 300, dtype=torch.int32))
    assert min(cfg.block_g, cfg.block_d, cfg.block_n) >= 16
    assert cfg.block_g >= heads // kv_heads and cfg.block_d >= head_dim
    # pieces of >= 128 tokens, and no more splits than 128-token pieces of the table allow
    assert cfg.min_split_tokens == 128 and 1 <= cfg.num_splits <= -(-300 * 16 // 128)
    with pytest.raises(ValueError, match="block_g"):
        DecodeLaunch(8, 64, 64, 1, 64, True)


@pytest.mark.parametrize("batch,kv_heads,ctx,splits", [
    (1, 8, 4096, 32),     # under-filled: 4 waves, capped at 128-token pieces
    (8, 4, 4096, 16),     # 32 programs on 132 SMs: 4 waves
    (8, 8, 32768, 8),     # 4 waves want 9 splits (4.4 waves, the fifth a third full): 8, 3.9 waves
    (64, 2, 1024, 4),
    (64, 4, 4096, 2),     # 256 programs >= 132 SMs: 2 waves
    (64, 8, 1024, 1),     # 512 programs: no split
])
def test_split_choice_from_the_h200_sweep(monkeypatch, batch, kv_heads, ctx, splits):
    """choose_launch's split counts on an H200's 132 SMs (bf16, block 16), the rule fitted to
    `bench/kernels.py --sweep` (docs/benchmarks.md)."""
    import kernels.paged_decode as pd

    monkeypatch.setattr(pd, "_sm_count", lambda device: 132)
    q = torch.empty(batch, 4 * kv_heads, 128, dtype=torch.bfloat16)
    cfg = choose_launch(q, torch.empty(1, 16, kv_heads, 128, dtype=torch.bfloat16),
                        torch.empty(batch, ctx // 16, dtype=torch.int32))
    assert cfg.num_splits == splits
    assert cfg.min_split_tokens == 128 and cfg.num_splits * 128 <= ctx


def test_fill_waves_takes_the_split_count_whose_last_wave_is_fullest():
    from kernels.paged_decode import _fill_waves

    assert _fill_waves(64, 132, 9, 64) == 8      # 576 programs = 4.4 waves; 512 = 3.9
    assert _fill_waves(32, 132, 17, 64) == 16    # 544 = 4.1 waves; 512 = 3.9
    assert _fill_waves(128, 132, 5, 8) == 5      # 4 and 5 both fill whole waves: a tie keeps want
    assert _fill_waves(64, 132, 9, 6) == 6       # the cap first: 6 x 64 = 2.9 waves, 4 x 64 = 1.9
    assert _fill_waves(8, 132, 66, 32) == 32     # under-filled, capped by the table: as before
    assert _fill_waves(2, 132, 1, 64) == 1
    for programs in (1, 3, 8, 28, 64, 130, 257):
        for want in range(1, 65):
            got = _fill_waves(programs, 132, want, 64)
            assert want / 2 < got <= want
            assert -(-programs * got // 132) / got <= -(-programs * want // 132) / want


def test_bad_inputs_name_the_argument():
    q, k, v, tables, lens_t = make_paged([5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, k, v, tables, lens_t.long(), 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k, v, tables[:, :, None], lens_t, 0.1)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q[:, :3], k, v, tables, lens_t, 0.1)
    with pytest.raises(ValueError, match="dtypes differ"):
        paged_decode_attention(q.half(), k, v, tables, lens_t, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k, v, tables, lens_t, 0.1, num_splits=0)



def test_layouts_and_dtypes_the_kernel_cannot_read_are_refused():
    # each of these ran and gave a silently wrong answer (or read past the table)
    q, k, v, tables, lens_t = make_paged([5, 9], 4, 2, 64, 16, torch.float32)
    wide = torch.zeros(tables.shape[1], 2, dtype=torch.int32).t()  # [B, blocks], column-major
    wide.copy_(tables)
    with pytest.raises(ValueError, match=r"block_tables rows must be contiguous, got stride \(1, 2\)"):
        paged_decode_attention(q, k, v, wide, lens_t, 0.1)
    pairs = torch.stack((lens_t, lens_t), dim=1)  # [B, 2]: a column is strided
    with pytest.raises(ValueError, match=r"context_lens must be contiguous, got stride \(2,\)"):
        paged_decode_attention(q, k, v, tables, pairs[:, 0], 0.1)
    for dt in (torch.float64, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=f"dtype {dt} is not supported"):
            paged_decode_attention(q.to(dt), k.to(dt), v.to(dt), tables, lens_t, 0.1)
    # a row slice of a wider table (the engine's CUDA graphs pass those) is fine
    assert check_inputs(q, k, v, torch.cat((tables, tables), 1)[:, :tables.shape[1]], lens_t) is None


def test_the_reference_refuses_lengths_past_the_block_table():
    q, k, v, tables, lens_t = make_paged([5, 9], 4, 2, 64, 16, torch.float32)
    room = tables.shape[1] * 16
    for bad in (room + 1, -1):
        lens = lens_t.clone()
        lens[1] = bad
        with pytest.raises(ValueError, match=rf"context_lens\[1\] = {bad} is outside \[0, {room}\]"):
            paged_decode_attention_ref(q, k, v, tables, lens, 0.1)


def test_without_triton_package_imports_and_refuses(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    assert not kernels.triton_available()
    q, k, v, tables, lens_t = make_paged([5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        paged_decode_attention(q, k, v, tables, lens_t, 0.1)
    paged_decode_attention_ref(q, k, v, tables, lens_t, 0.1)  # the reference needs no triton


def _run_py(code: str, **env) -> str:
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    res = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


SETUP = ("q = torch.randn(1, 2, 16); k = torch.randn(2, 16, 1, 16)\n"
         "t = torch.tensor([[1, 0]], dtype=torch.int32); l = torch.tensor([20], dtype=torch.int32)\n")


@pytest.mark.skipif(DEVICE != "cpu", reason="import-order check is for interpreter runs")
def test_imports_without_triton_and_interprets_when_env_set_later():
    """One fresh process: kernels/ imports with triton blocked; then, with kernels already
    imported and TRITON_INTERPRET set only afterwards, the kernel runs in the interpreter
    (kernels/ imports triton lazily)."""
    out = _run_py(
        "import os, sys, torch\n"
        "sys.modules['triton'] = None\n"
        "import kernels, kernels.paged_decode as pd, kernels.compile_check\n"
        "print('available', kernels.triton_available())\n"
        "del sys.modules['triton']\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n" + SETUP +
        "a = pd.paged_decode_attention(q, k, k, t, l, 0.25)\n"
        "b = pd.paged_decode_attention_ref(q, k, k, t, l, 0.25)\n"
        "print('err', float((a - b).abs().max()))")
    lines = dict(ln.split() for ln in out.strip().splitlines())
    assert lines["available"] == "False" and float(lines["err"]) < 1e-5


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the CUDA tests compile for real")
def test_compiles_for_gpu_and_refuses_late_interpret_env():
    """One fresh process without TRITON_INTERPRET: triton's real compiler builds the kernels
    for sm_90 down to cubin (no GPU needed), which catches what the interpreter lets through
    (dot shapes, dtypes, layouts); then setting TRITON_INTERPRET=1 after `import triton` is
    refused with a clear error instead of triton's cryptic one."""
    out = _run_py(
        "import json, os, torch, triton\n"
        "import kernels.paged_decode as pd\n"
        "from kernels.compile_check import compile_variant, DEFAULT_VARIANTS\n"
        "for r in compile_variant(DEFAULT_VARIANTS[0], 90): print(json.dumps(r))\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n" + SETUP +
        "try:\n    pd.paged_decode_attention(q, k, k, t, l, 0.25)\n"
        "except RuntimeError as e:\n    print('refused:', e)\n",
        TRITON_DEFAULT_FP_FUSION="1")
    assert out.count('"cubin_bytes"') == 2  # decode partial + reduce (all variants: -m slow)
    assert '"stack_bytes": 0' in out  # cuobjdump ran (no spills in the decode kernel)
    assert "refused: paged_decode_attention: TRITON_INTERPRET=1 was set after `import triton`" in out


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the CUDA tests compile for real")
def test_all_variants_compile_for_sm80_sm90():
    out = _run_py("from kernels.compile_check import main; main(['80', '90'])",
                  TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    assert out.count('"cubin_bytes"') == 2 * 11  # 2 targets x (5 variants x (partial [+ reduce]) + norm + rope)


def test_a_cache_of_2_31_elements_laid_out_head_major_is_read_right(tmp_path):
    """The documented [num_blocks, block_size, Hkv, Dh] shape, head-major in memory: head 2's
    offset (2 x 1.1e9 elements) wrapped in int32 and the kernel read other memory (a segfault in
    the interpreter; review, s53). The 6.6 GB of storage is a sparse file: a few pages written."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's case: on a GPU the 6.6 GB cache would be copied whole")
    hkv, nb, bs, dh = 3, 4_300_000, 16, 16
    n = hkv * nb * bs * dh
    path = tmp_path / "kv.bin"
    with open(path, "wb") as f:
        f.truncate(n * 2)
    base = torch.from_file(str(path), shared=True, size=n, dtype=torch.float16).view(hkv, nb, bs, dh)
    cache = base.permute(1, 2, 0, 3)  # [nb, bs, Hkv, Dh], stride_kh = nb * bs * dh
    g = torch.Generator().manual_seed(0)
    for h in range(hkv):
        base[h, 1:3] = torch.randn(2, bs, dh, generator=g).half()
    q = torch.randn(1, hkv, dh, generator=g).half()
    tables, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    ref = paged_decode_attention_ref(q, cache, cache, tables, lens, dh ** -0.5)
    out = paged_decode_attention(q, cache, cache, tables, lens, dh ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.float16])
