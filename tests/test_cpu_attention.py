"""The C++ paged attention kernel (engine attention backend "cpu") against a torch reference:
head sizes with a compiled-in specialisation (64, 128) and the generic path (16), GQA groups,
partial last blocks, scattered block tables, fp32 and bf16 caches."""
import pytest
import torch
from ext_helpers import extension_or_skip

torch.set_num_threads(1)


def _kernel():
    from workers.generation import cpu_attention

    extension_or_skip(cpu_attention, "C++ CPU attention kernel")
    return cpu_attention.paged_attention


def reference(q, kc, vc, tables, seq_of, positions, scale):
    """q: [T, H, Dh] -> [T, H, Dh]: token i attends to keys 0..positions[i] of its sequence."""
    h, hkv, bs = q.shape[1], kc.shape[2], kc.shape[1]
    out = torch.empty_like(q, dtype=torch.float32)
    for i in range(q.shape[0]):
        n = int(positions[i]) + 1
        blocks = tables[int(seq_of[i])][: -(-n // bs)].long()
        k = kc[blocks].reshape(-1, hkv, kc.shape[3])[:n].float().repeat_interleave(h // hkv, 1)  # [n, H, Dh]
        v = vc[blocks].reshape(-1, hkv, vc.shape[3])[:n].float().repeat_interleave(h // hkv, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float() * scale, k), -1)
        out[i] = torch.einsum("hn,nhd->hd", p, v)
    return out


# fp32 at Dh 64/128 takes the AVX-512 loops where the CPU has them: query heads in pairs per KV
# head (G = 2), an odd last one (G = 7, 3), none paired (G = 1)
@pytest.mark.parametrize("dh,h,hkv,dtype", [(64, 4, 2, torch.float32), (128, 14, 2, torch.float32),
                                            (64, 6, 2, torch.float32), (64, 2, 2, torch.float32),
                                            (16, 4, 4, torch.float32), (64, 6, 2, torch.bfloat16)])
def test_kernel_matches_reference(dh, h, hkv, dtype):
    attn = _kernel()
    g = torch.Generator().manual_seed(dh + h)
    bs, nb, b = 4, 40, 3
    kc = torch.randn(nb, bs, hkv, dh, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, dh, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[: b * 6].view(b, 6).int().contiguous()
    # decode-like (one query per sequence) and prefill-like (several positions of one sequence)
    seq_of = torch.tensor([0, 1, 2, 2, 2, 2], dtype=torch.int64)
    positions = torch.tensor([0, 22, 5, 6, 7, 15], dtype=torch.int64)
    q = torch.randn(6, h, dh, generator=g).to(dtype)
    got = attn(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    want = reference(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_with_blocks_of_128_tokens(cache_dtype):
    """Blocks of 128 tokens (vLLM's CPU default; bench/engine_throughput.py runs the engine with
    it): a block's rows are copied as one 64 KB run; contexts inside one block, across two and
    three with partial tails, and a prefill chunk that crosses a block boundary."""
    attn = _kernel()
    g = torch.Generator().manual_seed(128)
    bs, nb, dh, h, hkv = 128, 12, 64, 4, 2
    kc = torch.randn(nb, bs, hkv, dh, generator=g).to(cache_dtype)
    vc = torch.randn(nb, bs, hkv, dh, generator=g).to(cache_dtype)
    tables = torch.randperm(nb, generator=g)[:9].view(3, 3).int().contiguous()
    seq_of = torch.tensor([0, 1, 2, 2, 2, 2], dtype=torch.int64)
    positions = torch.tensor([100, 300, 126, 127, 128, 129], dtype=torch.int64)
    q = torch.randn(6, h, dh, generator=g)
    got = attn(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, seq_of, positions, dh ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dh,h,hkv,cache_dtype", [(64, 4, 2, torch.bfloat16), (128, 14, 2, torch.bfloat16),
                                                  (16, 4, 2, torch.bfloat16), (64, 4, 2, torch.float16)])
def test_kernel_fp32_query_over_16bit_cache(dh, h, hkv, cache_dtype):
    """kv_cache_dtype: an fp32 q over a bf16/fp16 cache computes in fp32 on the rounded K/V,
    i.e. exactly the fp32 attention of the rounded values; the output stays fp32."""
    attn = _kernel()
    g = torch.Generator().manual_seed(dh + 7)
    bs, nb, b = 16, 30, 3
    kc = torch.randn(nb, bs, hkv, dh, generator=g).to(cache_dtype)
    vc = torch.randn(nb, bs, hkv, dh, generator=g).to(cache_dtype)
    tables = torch.randperm(nb, generator=g)[: b * 8].view(b, 8).int().contiguous()
    seq_of = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int64)
    positions = torch.tensor([0, 70, 3, 17, 127], dtype=torch.int64)  # partial blocks, 4-row tails
    q = torch.randn(5, h, dh, generator=g)
    got = attn(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    want = reference(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_a_16bit_query_over_another_cache_dtype():
    attn = _kernel()
    kc = torch.zeros(2, 4, 1, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="caches must have q's dtype"):
        attn(torch.zeros(1, 1, 16, dtype=torch.bfloat16), kc, kc, torch.zeros(1, 1, dtype=torch.int32),
             torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0.25)


@pytest.mark.parametrize("ntok", [1, 5])
@pytest.mark.parametrize("dh,h,hkv", [(64, 4, 2), (128, 14, 2), (16, 6, 3)])
def test_kernel_split_over_kv_heads_and_long_contexts(ntok, dh, h, hkv):
    """Fewer query tokens than 2 per thread: each token's KV heads become separate work items
    (a single long sequence still uses every thread). Contexts of many blocks with growing
    score scales exercise the online softmax's rescaling across blocks."""
    attn = _kernel()
    g = torch.Generator().manual_seed(ntok * 100 + dh)
    bs, nb = 16, 64
    kc = torch.randn(nb, bs, hkv, dh, generator=g)
    kc *= torch.linspace(0.1, 3.0, nb)[torch.randperm(nb, generator=g)][:, None, None, None]
    vc = torch.randn(nb, bs, hkv, dh, generator=g)
    tables = torch.randperm(nb, generator=g)[:60].view(2, 30).int().contiguous()
    seq_of = torch.tensor([0, 1, 1, 0, 1][:ntok], dtype=torch.int64)
    positions = torch.tensor([479, 300, 17, 8, 450][:ntok], dtype=torch.int64)
    q = torch.randn(ntok, h, dh, generator=g) * 2
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = attn(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    finally:
        torch.set_num_threads(threads)
    want = reference(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy_and_refuses_a_slot_outside(cache_dtype):
    """The engine's K/V write: rows of strided views (k, v of a fused qkv projection) land in
    their slots as index_copy_ puts them (rounded to nearest even into a bf16 cache)."""
    from workers.generation import cpu_ops

    extension_or_skip(cpu_ops, "C++ fused CPU ops")
    torch.manual_seed(0)
    kc, vc = torch.zeros(6, 16, 2, 64, dtype=cache_dtype), torch.zeros(6, 16, 2, 64, dtype=cache_dtype)
    qkv = torch.randn(5, 4 * 64 + 2 * 2 * 64)
    k, v = qkv[:, 256:384].view(5, 2, 64), qkv[:, 384:].view(5, 2, 64)
    slots = torch.tensor([3, 17, 40, 95, 0])
    cpu_ops.load().write_kv(kc, vc, k, v, slots)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    want_k.view(-1, 2, 64).index_copy_(0, slots, k.to(cache_dtype))
    want_v.view(-1, 2, 64).index_copy_(0, slots, v.to(cache_dtype))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(RuntimeError, match="slot 96 of token 4 is outside the cache"):
        cpu_ops.load().write_kv(kc, vc, k, v, torch.tensor([0, 1, 2, 3, 96]))
    with pytest.raises(RuntimeError, match="write_kv: k and v must be"):
        cpu_ops.load().write_kv(kc, vc, k, v[:, :1], slots)


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_batch_with_next_block_prefetch(threads):
    """A decode batch (one token per sequence, >= 2 per thread: whole rows per item), contexts
    of one to four blocks of 128 with partial tails: each block's successor, and the next
    token's first block, are prefetched during the arithmetic; the result is the reference's."""
    attn = _kernel()
    g = torch.Generator().manual_seed(29)
    bs, nb, dh, h, hkv, b = 128, 40, 64, 4, 2, 9
    kc = torch.randn(nb, bs, hkv, dh, generator=g)
    vc = torch.randn(nb, bs, hkv, dh, generator=g)
    tables = torch.randperm(nb, generator=g)[: b * 4].view(b, 4).int().contiguous()
    seq_of = torch.arange(b, dtype=torch.int64)
    positions = torch.tensor([0, 127, 128, 300, 511, 5, 255, 256, 400], dtype=torch.int64)
    q = torch.randn(b, h, dh, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attn(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, reference(q, kc, vc, tables, seq_of, positions, dh ** -0.5), rtol=1e-5, atol=1e-5)


def test_strided_sequence_and_position_indices_are_read_as_their_values():
    """(The kernel reads seq_of / positions as contiguous: a column of a [T, 2] index tensor
    was read as other values, wrong output or reads past the block table.)"""
    attn = _kernel()
    g = torch.Generator().manual_seed(7)
    kc, vc = torch.randn(40, 4, 2, 16, generator=g), torch.randn(40, 4, 2, 16, generator=g)
    tables = torch.randperm(40, generator=g)[:18].view(3, 6).int().contiguous()
    index = torch.tensor([[0, 0], [1, 22], [2, 5], [2, 15]], dtype=torch.int64)
    seq_of, positions = index[:, 0], index[:, 1]
    assert not seq_of.is_contiguous() and not positions.is_contiguous()
    q = torch.randn(4, 4, 16, generator=g)
    torch.testing.assert_close(attn(q, kc, vc, tables, seq_of, positions, 0.25),
                               reference(q, kc, vc, tables, seq_of, positions, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dh,dtype", [(64, torch.float32), (16, torch.float32), (64, torch.bfloat16)])
def test_large_scores_are_softmaxed_stably(dh, dtype):
    """Scaled q.k scores of ~100-300 (a model's attention-sink logits can be that large): the
    online softmax subtracts each head's running max, so exp never overflows; a softmax
    without it saturates (exp clamps at 88) and gives other weights or NaN."""
    attn = _kernel()
    g = torch.Generator().manual_seed(5)
    bs, nb, h, hkv = 4, 24, 4, 2
    kc = torch.randn(nb, bs, hkv, dh, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, dh, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g)[:20].view(2, 10).int().contiguous()
    seq_of = torch.tensor([0, 1, 1], dtype=torch.int64)
    positions = torch.tensor([3, 17, 38], dtype=torch.int64)
    q = (torch.randn(3, h, dh, generator=g) * 100).to(dtype)
    got = attn(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    want = reference(q, kc, vc, tables, seq_of, positions, dh ** -0.5)
    assert float((q[0].float() @ kc[tables[0, 0].long(), :, 0].float().T).abs().max()) * dh ** -0.5 > 100
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)


def test_indices_outside_the_cache_are_refused():
    """A block id past the cache or a position past the block table is an error, not a read
    of other memory."""
    attn = _kernel()
    kc = torch.zeros(5, 4, 1, 16)
    q = torch.zeros(1, 1, 16)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="block_tables holds block 5 of 5"):
        attn(q, kc, kc, torch.tensor([[0, 5]], dtype=torch.int32), one, one, 0.25)
    with pytest.raises(RuntimeError, match=r"positions\[0\] = 8 is outside its block table"):
        attn(q, kc, kc, torch.tensor([[0, 1]], dtype=torch.int32), one, torch.tensor([8]), 0.25)
