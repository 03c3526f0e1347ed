"""Engine parts on their own: config validation, block manager (ref counts, copy-on-write),
sampler (filters, seeds, log-probs of the distribution used), make_engine from a folder."""
import re

import pytest
import torch

from workers.generation.block_manager import BlockManager
from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.generation.factory import make_engine
from workers.generation.sampler import Sampler
from workers.generation.sequence import Sequence
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained
from workers.types import Request, SamplingParams

torch.set_num_threads(1)


@pytest.mark.parametrize("kw, key", [
    (dict(backend="x"), "engine.backend"), (dict(max_batch_size=0), "engine.max_batch_size"),
    (dict(block_size=0), "engine.block_size"), (dict(admission="sjf"), "engine.admission"),
    (dict(attention_backend="cuda"), "engine.attention_backend"), (dict(dtype="fp8"), "engine.dtype"),
    (dict(kv_cache_tokens=4, block_size=16), "engine.kv_cache_tokens"), (dict(device="tpu"), "engine.device"),
    (dict(eos_ids=(-1,)), "engine.eos_ids"), (dict(eos_ids=(True,)), "engine.eos_ids[0]: expected int, got bool"),
    # a string is truthy: "false" switched prefix sharing on
    (dict(prefix_sharing="false"), "engine.prefix_sharing: expected bool, got str 'false'"),
    (dict(enforce_eager="no"), "engine.enforce_eager"), (dict(enable_chunked_prefill=0), "engine.enable_chunked_prefill"),
    (dict(max_batch_size=True), "engine.max_batch_size"),
    (dict(seed=1.5), "engine.seed: expected int, got float 1.5"), (dict(seed="7"), "engine.seed"),
    (dict(seed=2 ** 64), "engine.seed"), (dict(seed=-1), "engine.seed"), (dict(seed=2 ** 32), "engine.seed"),
    (dict(cpu_prepack="off"), "engine.cpu_prepack: must be 'auto', true or false, got 'off'"),
    (dict(cpu_prepack=0), "engine.cpu_prepack")])
def test_config_validation_names_key(kw, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        EngineConfig(**kw)


def test_a_list_of_eos_ids_is_stored_as_the_file_s_tuple():
    assert EngineConfig(eos_ids=[2, 5]).eos_ids == (2, 5)  # as build_section reads a YAML list
    hash(EngineConfig(eos_ids=[2, 5]))  # the frozen config stays hashable


def seq(n_tokens: int, sid: int = 0) -> Sequence:
    return Sequence.from_request(Request(sample_id=sid, prompt_ids=torch.arange(n_tokens), max_tokens=4), sid)


def test_block_manager_refcount_and_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(6)
    assert bm.new_blocks_needed(a, 6) == 2 and bm.prepare_write(a, 6) is None
    a.num_cached = 6
    b = seq(6, 1)
    bm.share(b, a.block_table)
    b.num_cached = 5  # shares tokens 0..4; token 5 lives in a shared partial block -> copy
    assert bm.new_blocks_needed(b, 7) == 1
    src, dst = bm.prepare_write(b, 7)
    assert src == a.block_table[1] and dst not in a.block_table and b.block_table[0] == a.block_table[0]
    assert bm.ref[a.block_table[0]] == 2 and bm.ref[a.block_table[1]] == 1 and bm.num_free == 5
    bm.free(a)
    assert bm.num_free == 6 and bm.ref[b.block_table[0]] == 1
    bm.free(b)
    assert bm.num_free == 8 and bm.num_used == 0


def test_prefix_cache_lookup_needs_the_same_group_and_prompt():
    """A group's pinned prompt blocks serve only a sample of the same group with the same
    prompt tokens: a same-length prompt with other tokens (or another length) under the same
    group id must compute its own prompt, not read another prompt's K/V."""
    from workers.generation.prefix_cache import PrefixCache

    def member(sid, ids, group=7):
        return Sequence.from_request(Request(sample_id=sid, prompt_ids=torch.tensor(ids), max_tokens=4,
                                             group_id=group), sid)

    bm = BlockManager(num_blocks=8, block_size=4)
    cache = PrefixCache(bm)
    owner = member(0, [5, 6, 7, 8, 9, 10])
    assert cache.lookup(owner) is None  # nothing pinned yet
    bm.prepare_write(owner, 6)
    cache.pin(owner)  # tokens [0, 5) -> 2 blocks
    g = cache.groups[7]
    assert g.blocks == owner.block_table[:2] and bm.ref[g.blocks[0]] == 2
    assert cache.lookup(member(1, [5, 6, 7, 8, 9, 10])) is g
    assert cache.lookup(member(2, [5, 6, 7, 8, 9, 11])) is None  # same length, other tokens
    assert cache.lookup(member(3, [5, 6, 7, 8, 9])) is None  # a prefix of it
    assert cache.lookup(member(4, [5, 6, 7, 8, 9, 10], group=8)) is None  # another group
    cache.release(7)
    assert cache.groups == {} and bm.ref[owner.block_table[0]] == 1


def _seq_with(sp: SamplingParams, min_tokens=0, sid=0) -> Sequence:
    return Sequence.from_request(Request(sample_id=sid, prompt_ids=torch.tensor([1]), max_tokens=9,
                                         min_tokens=min_tokens, sampling=sp), sid)


def _fused(kind: str):
    """None: the torch sampler; "cpu": with the engine's compiled ``cpu_ops.sample``."""
    if kind == "torch":
        return None
    from ext_helpers import extension_or_skip

    from workers.generation import cpu_ops
    return extension_or_skip(cpu_ops, "C++ fused CPU ops")


@pytest.mark.parametrize("kind", ["torch", "cpu"])
def test_sampler_greedy_filters_and_logprobs(kind):
    s = Sampler(eos_ids=(0,), device=torch.device("cpu"), seed=0, fused=_fused(kind))
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0], [0.0, 1.0, 3.0, 2.5], [2.0, 2.0, 1.0, 9.0]])
    seqs = [_seq_with(SamplingParams(temperature=0.0), min_tokens=1),
            _seq_with(SamplingParams(temperature=0.7, top_k=1), sid=1),
            _seq_with(SamplingParams(temperature=0.5, top_p=0.01), sid=2)]
    ids, lp = s(logits.clone(), seqs)
    assert ids.tolist() == [1, 2, 3]  # row 0: EOS (id 0) masked before min_tokens
    masked = logits[0].clone()
    masked[0] = float("-inf")
    assert lp[0] == pytest.approx(float(torch.log_softmax(masked, -1)[1]))
    assert lp[1] == pytest.approx(0.0) and lp[2] == pytest.approx(0.0)  # filters leave one token


@pytest.mark.parametrize("kind", ["torch", "cpu"])
def test_sampler_seed_reproducible_and_distribution(kind):
    s = Sampler(eos_ids=(), device=torch.device("cpu"), seed=0, fused=_fused(kind))
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    sp = SamplingParams(temperature=1.0, seed=7)
    a, b = _seq_with(sp), _seq_with(sp)
    draws_a = [int(s(logits.clone(), [a])[0]) for _ in range(20)]
    draws_b = [int(s(logits.repeat(2, 1), [b, _seq_with(SamplingParams(), sid=3)])[0][0]) for _ in range(20)]
    assert draws_a == draws_b
    unseeded = _seq_with(SamplingParams(temperature=1.0))
    counts = torch.bincount(torch.tensor([int(s(logits.clone(), [unseeded])[0]) for _ in range(2000)]), minlength=4)
    torch.testing.assert_close(counts / 2000, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.04, rtol=0)
    # returned log-prob: that of the token actually drawn, under the row's own filtered
    # distribution, for every row of a batch mixing parameters
    l0 = logits[0]
    ninf = float("-inf")
    kinds = [(SamplingParams(temperature=2.0, top_k=3),  # token 0 (smallest) filtered out
              torch.log_softmax(torch.cat([torch.tensor([ninf]), l0[1:] / 2.0]), -1)),
             (SamplingParams(temperature=0.5, top_p=0.7),  # p^2 normalised: keeps ids 3 and 2
              torch.log_softmax(torch.tensor([ninf, ninf, float(l0[2]), float(l0[3])]) / 0.5, -1)),
             (SamplingParams(temperature=1.0), torch.log_softmax(l0, -1))]
    rows = [kinds[i % 3] for i in range(150)]
    seqs = [_seq_with(sp, sid=i) for i, (sp, _) in enumerate(rows)]
    ids, lp = s(logits.repeat(len(rows), 1), seqs)
    want = torch.stack([w[int(t)] for (_, w), t in zip(rows, ids)])
    assert torch.isfinite(want).all()  # no filtered-out token was drawn
    torch.testing.assert_close(lp, want.float(), atol=1e-5, rtol=0)
    # each kind drew more than one distinct token (else a fixed token's log-prob would pass)
    assert [sorted(set(ids[k::3].tolist())) for k in range(3)] == [[1, 2, 3], [2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cpu_sampler_draws_what_the_torch_sampler_draws(dtype):
    """Same engine seed, same requests: the C++ draw (no top-k/top-p in the batch) picks the
    torch path's tokens - greedy, temperatures, seeded and unseeded rows, EOS masked before
    min_tokens - with the same log-probs, from fp32 and bf16 logits (a bf16 model's); a batch
    asking for top-k goes the torch way."""
    fused = _fused("cpu")
    torch.manual_seed(0)
    logits = (torch.randn(96, 300) * 3).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.6, seed=11), SamplingParams(temperature=1.7)]

    def batch():
        return [_seq_with(params[i % 4], sid=i, min_tokens=5 if i % 3 == 0 else 0) for i in range(96)]

    a = Sampler(eos_ids=(2, 5), device=torch.device("cpu"), seed=3)
    b = Sampler(eos_ids=(2, 5), device=torch.device("cpu"), seed=3, fused=fused)
    sa, sb = batch(), batch()
    for _ in range(3):  # seeded rows' generators advance step by step
        ids_a, lp_a = a(logits.clone(), sa)
        ids_b, lp_b = b(logits.clone(), sb)
        assert ids_b.tolist() == ids_a.tolist()
        torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    assert len(set(ids_b.tolist())) > 40  # random rows: many distinct tokens
    assert not {int(t) for t in ids_b[::3]} & {2, 5}  # EOS masked before min_tokens
    calls = []
    b.fused = type("Spy", (), {"sample": lambda self, *x: calls.append(x)})()
    b(logits[:2].clone(), [_seq_with(SamplingParams(temperature=1.0, top_k=3)), _seq_with(SamplingParams())])
    assert calls == []


def test_fused_cpu_sampler_never_draws_a_token_without_mass_at_the_top_of_the_draw():
    """A draw u near 1 (legal: u in [0, 1)) fell past the running sum when the fp32 total the
    target was scaled by rounded above the fp64 sum the scan takes, and took the last id whatever
    its probability: a blocked EOS (id V - 1 here) with log-prob -1e30 in 9 of 20 rows of a
    Qwen-sized vocabulary."""
    ops = _fused("cpu")
    V = 151936
    eos = torch.tensor([V - 1])
    for seed in range(20):
        logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 2
        for u in (1 - 2.0 ** -40, 0.9999999, 0.0):
            ids, lp = ops.sample(logits, eos, torch.tensor([True]), torch.tensor([False]), torch.tensor([1.0]),
                                 torch.tensor([u], dtype=torch.float64))
            assert int(ids[0]) != V - 1 and float(lp[0]) > -1e3, (seed, u)
    # u near 1 draws the last token with mass (V - 2: V - 1 is the blocked EOS)
    logits = torch.zeros(1, V)
    ids, _ = ops.sample(logits, eos, torch.tensor([True]), torch.tensor([False]), torch.tensor([1.0]),
                        torch.tensor([1 - 2.0 ** -40], dtype=torch.float64))
    assert int(ids[0]) == V - 2


@pytest.mark.parametrize("kind", ["torch", "cpu"])
def test_sampler_keeps_a_batchs_parameters_only_while_the_batch_is_the_same(kind):
    # the rows' parameters are kept between calls on the same sequences (a decode batch);
    # another batch of the same size, greedy where the first sampled, gets its own
    s = Sampler(eos_ids=(0,), device=torch.device("cpu"), seed=0, fused=_fused(kind))
    logits = torch.tensor([[0.0, 1.0, 1.1, 0.9]]).repeat(4, 1)
    hot = [_seq_with(SamplingParams(temperature=50.0), sid=i) for i in range(4)]
    cold = [_seq_with(SamplingParams(temperature=0.0), sid=10 + i) for i in range(4)]
    drawn = {int(t) for _ in range(10) for t in s(logits.clone(), hot)[0]}
    assert len(drawn) >= 3  # T=50: near uniform
    for _ in range(3):
        assert s(logits.clone(), cold)[0].tolist() == [2, 2, 2, 2]  # greedy
    # the same batch again: its EOS masking is recomputed every call
    s2 = Sampler(eos_ids=(1,), device=torch.device("cpu"), seed=0, fused=_fused(kind))
    mins = [_seq_with(SamplingParams(temperature=0.0), min_tokens=2, sid=20 + i) for i in range(2)]
    sharp = torch.tensor([[0.0, 9.0, 1.0, 0.0]]).repeat(2, 1)
    assert s2(sharp.clone(), mins)[0].tolist() == [2, 2]  # EOS (1) masked: 0 outputs < 2
    for m in mins:
        m.tokens += [3, 3]
    assert s2(sharp.clone(), mins)[0].tolist() == [1, 1]  # 2 outputs: EOS allowed


def test_fused_draw_gives_a_masked_eos_no_mass_even_at_u_zero():
    """A masked EOS column has probability exactly 0: the smallest uniform draws the first
    unmasked token (as the torch path's searchsorted does), and its log-prob is finite."""
    ops = _fused("cpu")
    logits = torch.tensor([[9.0, 1.0, 2.0], [9.0, 1.0, 2.0]])
    ids, lp = ops.sample(logits, torch.tensor([0]), torch.tensor([True, False]), torch.tensor([False, False]),
                         torch.ones(2), torch.zeros(2, dtype=torch.float64))
    assert ids.tolist() == [1, 0]
    assert lp[0] == pytest.approx(float(torch.log_softmax(torch.tensor([1.0, 2.0]), -1)[0]), abs=1e-6)


def test_fused_draw_of_nan_logits_stays_in_the_vocabulary():
    """A diverged model's NaN logits give a token id inside the vocabulary and a NaN log-prob
    (the trainer's non-finite checks take it from there), not a read past the row."""
    ops = _fused("cpu")
    ids, lp = ops.sample(torch.full((2, 50), float("nan")), torch.empty(0, dtype=torch.int64),
                         torch.tensor([False, False]), torch.tensor([True, False]), torch.ones(2),
                         torch.full((2,), 0.5, dtype=torch.float64))
    assert all(0 <= i < 50 for i in ids.tolist()) and torch.isnan(lp).all()
    # one NaN (or +inf) logit in a row: NaN too, as torch's log_softmax (the C++ is built with
    # -ffast-math, whose max / argmax skipped it: a finite log-prob for a bad row)
    logits = torch.randn(4, 50)
    logits[:2, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, 9] = float("-inf")  # -inf: a token with no mass, the row is fine
    ids, lp = ops.sample(logits, torch.empty(0, dtype=torch.int64), torch.zeros(4, dtype=torch.bool),
                         torch.tensor([True, False, False, False]), torch.ones(4),
                         torch.full((4,), 0.5, dtype=torch.float64))
    assert torch.isnan(lp[:3]).all() and torch.isfinite(lp[3]) and ids[3] != 9


def test_fused_draw_of_a_row_whose_only_mass_is_a_blocked_eos_is_nan():
    """Every other logit -inf, EOS blocked below min_tokens: the draw took the masked EOS with
    log-prob 0 (finite: min_tokens broken without a sign), where torch's path gives NaN (review,
    s53). Greedy, and temperatures whose 1/T rounds either way (the mask is scaled with the logits:
    a threshold of -1e30 / T missed 0.19, 0.38, 0.91, 1.02, ...; review of the fix)."""
    ops = _fused("cpu")
    temps = [1.0, 1.0, 1.5, 0.19, 0.21, 0.38, 0.76, 0.91, 0.99, 1.02, 1.52]
    n = len(temps)
    logits = torch.full((n, 50), float("-inf"))
    logits[:, 3] = 0.0
    ids, lp = ops.sample(logits, torch.tensor([3]), torch.ones(n, dtype=torch.bool),
                         torch.tensor([True] + [False] * (n - 1)), torch.tensor(temps),
                         torch.full((n,), 0.5, dtype=torch.float64))
    assert torch.isnan(lp).all() and all(0 <= i < 50 for i in ids.tolist())


def test_make_engine_from_folder_and_eos_override(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=3)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    eng = make_engine(EngineConfig(device="cpu"), str(tmp_path / "m"))
    assert isinstance(eng, NativeEngine) and eng.eos_ids == (3,)
    assert next(eng.model.parameters()).dtype == torch.float32
    eng2 = make_engine(EngineConfig(device="cpu"), str(tmp_path / "m"), eos_ids=[5, 6])
    assert eng2.eos_ids == (5, 6)
    out = generate_all(eng2, [Request(sample_id=0, prompt_ids=torch.tensor([1, 2]), max_tokens=3,
                                      sampling=SamplingParams(temperature=0))])
    assert len(out) == 1 and 1 <= len(out[0].output_ids) <= 3


def test_bf16_weights_fp32_compute_on_cpu(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    eng = make_engine(EngineConfig(device="cpu", dtype="bfloat16", cpu_half_compute="float32"), str(tmp_path / "m"))
    w = eng.model.model.norm.weight
    assert w.dtype == torch.float32 and eng.weight_dtype == torch.bfloat16
    eng.load_weights([("model.norm.weight", torch.full((32,), 1.001))], version=1)
    assert float(w[0]) == float(torch.tensor(1.001).bfloat16())  # rounded to bf16 values
    native = make_engine(EngineConfig(device="cpu", dtype="bfloat16", cpu_half_compute="native"), str(tmp_path / "m"))
    assert next(native.model.parameters()).dtype == torch.bfloat16
    req = [Request(sample_id=0, prompt_ids=torch.tensor([1, 2, 3]), max_tokens=4, min_tokens=4,
                   sampling=SamplingParams(temperature=0))]
    assert len(generate_all(native, req)[0].output_ids) == 4


def test_cpu_prepack_key_reaches_the_forward(tmp_path, monkeypatch):
    """engine.cpu_prepack: false keeps the plain GEMMs (less memory), true forces the prepacked
    ones, and true where they cannot run is refused at start naming the key."""
    from workers.generation import panel_gemm, prepacked

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    req = [Request(sample_id=0, prompt_ids=torch.tensor([1, 2, 3]), max_tokens=5, min_tokens=5,
                   sampling=SamplingParams(temperature=0))]
    off = make_engine(EngineConfig(device="cpu", cpu_prepack=False), str(tmp_path / "m"))
    assert not off.runner.forward.prepack and off.runner.forward.packed == []
    want = generate_all(off, req)[0].output_ids.tolist()
    if panel_gemm.available(torch.float32) or prepacked.available(torch.float32):
        on = make_engine(EngineConfig(device="cpu", cpu_prepack=True), str(tmp_path / "m"))
        assert on.runner.forward.prepack
        assert generate_all(on, req)[0].output_ids.tolist() == want
    monkeypatch.setattr(panel_gemm, "available", lambda dtype: False)
    monkeypatch.setattr(prepacked, "available", lambda dtype: False)
    with pytest.raises(ValueError, match=r"^engine\.cpu_prepack: prepacked GEMMs do not run here"):
        make_engine(EngineConfig(device="cpu", cpu_prepack=True), str(tmp_path / "m"))
    assert not make_engine(EngineConfig(device="cpu"), str(tmp_path / "m")).runner.forward.prepack  # auto


def test_attention_backend_auto(monkeypatch):
    """"auto": the triton kernel (and CUDA-graph decode) on CUDA where it applies, else torch.
    The CUDA side is resolved with triton_usable faked (no GPU here; tests/test_cuda.py runs it)."""
    import kernels
    from workers.generation.config import EngineConfig
    from workers.generation.engine import resolve_attention_backend

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert EngineConfig().attention_backend == "auto"
    assert resolve_attention_backend(EngineConfig(), cpu) == "torch"
    assert resolve_attention_backend(EngineConfig(attention_backend="cpu"), cpu) == "cpu"
    monkeypatch.setattr(kernels, "triton_usable", lambda device: torch.device(device).type == "cuda")
    assert resolve_attention_backend(EngineConfig(block_size=16), cuda) == "triton"
    assert resolve_attention_backend(EngineConfig(block_size=4), cuda) == "torch"  # kernel tested on 16, 32
    assert resolve_attention_backend(EngineConfig(kv_cache_dtype="bfloat16"), cuda) == "torch"
    assert resolve_attention_backend(EngineConfig(attention_backend="torch"), cuda) == "torch"
    monkeypatch.setattr(kernels, "triton_usable", lambda device: False)  # triton not installed
    assert resolve_attention_backend(EngineConfig(), cuda) == "torch"
