"""NativeEngine correctness: greedy output equals greedy decoding by full recomputation (no
cache) for mixed-length prompts, across preemption and with prefix sharing; forced lengths,
EOS, refusals, admission order, batch cap. In-place weights: test_engine_load_weights.py."""
import pytest
import torch
from ext_helpers import extension_or_skip

from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.model import CausalLM, ModelConfig, init_weights
from workers.types import Request, SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)
V = 97


def tiny_model(seed: int = 0) -> CausalLM:
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    # std 0.2: peaked logits, so greedy argmax is not decided by float rounding
    return init_weights(CausalLM(cfg), seed=seed, std=0.2).eval()


MODEL = tiny_model()


_RECOMPUTED: dict = {}


@torch.no_grad()
def recompute_greedy(model: CausalLM, prompt: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with no cache: the whole sequence is re-run for every token
    (memoized per model, prompt and length: several tests check the same prompts)."""
    key = (model, tuple(prompt.tolist()), n)  # the key keeps the model alive: no id reuse
    if key not in _RECOMPUTED:
        _RECOMPUTED[key] = _recompute(model, prompt, n)
    return _RECOMPUTED[key]


def _recompute(model: CausalLM, prompt: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    seq, out, lps = prompt.to(next(model.parameters()).device), [], []  # CUDA too (test_cuda.py)
    for _ in range(n):
        logits = model.forward_packed([seq])[-1].float()
        t = logits.argmax()
        out.append(int(t))
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        seq = torch.cat([seq, t[None]])
    return out, lps


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def greedy_requests(ps, n_new, group_of=None):
    return [Request(sample_id=i, prompt_ids=p, max_tokens=n_new, min_tokens=n_new, sampling=GREEDY,
                    group_id=-1 if group_of is None else group_of[i]) for i, p in enumerate(ps)]


def engine(model=MODEL, **kw) -> NativeEngine:
    base = dict(block_size=4, kv_cache_tokens=4096, max_batch_size=8)
    base.update(kw)
    return NativeEngine(EngineConfig(**base), model=model)


def check_against_recompute(reqs, samples, model=MODEL):
    for r, s in zip(reqs, samples):
        want, want_lp = recompute_greedy(model, r.prompt_ids, r.max_tokens)
        assert s.sample_id == r.sample_id
        assert s.output_ids.tolist() == want, f"sample {r.sample_id}"
        torch.testing.assert_close(s.logprobs, torch.tensor(want_lp), rtol=1e-4, atol=1e-4)


PS = prompts([1, 5, 17, 33, 2, 16, 9, 4])


@pytest.mark.parametrize("backend", ["auto", "torch"])  # torch: the gather + SDPA path (GPU without triton)
def test_greedy_equals_recompute_mixed_lengths(backend):
    reqs = greedy_requests(PS, 14)
    eng = engine(max_batch_size=3, attention_backend=backend)  # requests are admitted as others finish
    out = generate_all(eng, reqs)
    check_against_recompute(reqs, out)
    assert all(s.finish_reason == "length" and len(s.output_ids) == 14 for s in out)
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.running == st.waiting == 0 and st.preemptions == 0


def test_greedy_equals_recompute_across_preemption():
    reqs = greedy_requests(PS, 14)
    eng = engine(kv_cache_tokens=64)  # 16 blocks of 4: cannot hold all 8 sequences
    out = generate_all(eng, reqs)
    assert eng.stats().preemptions > 0
    check_against_recompute(reqs, out)
    assert eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_stale_nan_in_free_cache_slots_reaches_no_sequence(backend):
    """A freed block keeps what its last sequence wrote (a NaN from an overflowed activation
    too): the slots past each sequence's context are masked and their K/V never read into the
    output (0 * NaN is NaN), so every sample still equals recomputation."""
    eng = engine(attention_backend=backend)
    for kc, vc in zip(eng.runner.cache.k, eng.runner.cache.v):
        kc.fill_(float("nan")), vc.fill_(float("nan"))
    reqs = greedy_requests(PS, 6)
    check_against_recompute(reqs, generate_all(eng, reqs))


@pytest.mark.parametrize("kv_tokens", [4096, 80])
def test_prefix_sharing_equals_recompute(kv_tokens):
    ps = prompts([7, 8, 13])
    group_of = [i // 4 for i in range(12)]
    reqs = greedy_requests([ps[g] for g in group_of], 10, group_of)
    eng = engine(kv_cache_tokens=kv_tokens, max_batch_size=12)
    peak = 0
    got = []
    eng.add(reqs)
    while eng.has_work():
        got += eng.step()
        peak = max(peak, eng.stats().kv_blocks_used)
    got.sort(key=lambda s: s.sample_id)
    check_against_recompute(reqs, got)
    assert eng.stats().kv_blocks_used == 0 and not eng.prefix.groups  # pins released
    if kv_tokens == 4096:  # shared prompts use fewer blocks than 12 private copies would
        private = sum(-(-(len(r.prompt_ids) + 10) // 4) for r in reqs)
        assert peak < private
    else:
        assert eng.stats().preemptions > 0


def test_kv_peak_is_the_most_blocks_held_at_once_in_a_busy_period():
    # one sequence alone: its table grows to hold prompt + output (the last token written
    # too: the finishing step allocates its slot, then frees everything)
    eng = engine()
    (req,) = greedy_requests(prompts([9]), 14)
    seen = 0
    eng.add([req])
    while eng.has_work():
        eng.step()
        seen = max(seen, eng.stats().kv_blocks_used)
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.kv_blocks_peak == -(-(9 + 14 - 1) // 4) >= seen
    # a new busy period counts from its own start: a shorter request, a smaller peak
    generate_all(eng, greedy_requests(prompts([2]), 3))
    assert eng.stats().kv_blocks_peak == -(-(2 + 3 - 1) // 4)
    # a cache too small for the batch: full at its peak, then preemptions
    eng = engine(kv_cache_tokens=64)
    generate_all(eng, greedy_requests(PS, 14))
    st = eng.stats()
    assert st.preemptions > 0 and st.kv_blocks_peak == st.kv_blocks_free == 16


def test_kv_peak_leaves_out_cached_blocks_a_waiting_request_matched_and_gave_back():
    # a request that matched cached blocks by hash, then did not fit and gave them back, counted
    # them in the peak: 24 of 24 blocks reported where steps held 18 at most (review, s54)
    eng = engine(kv_cache_tokens=96, prefix_caching=True, prefix_sharing=False, attention_backend="torch")
    g = torch.Generator().manual_seed(0)
    pa = torch.randint(3, V, (33,), generator=g)
    generate_all(eng, greedy_requests([pa], 1))
    pb, pc = torch.randint(3, V, (60,), generator=g), torch.cat([pa[:32], torch.randint(3, V, (40,), generator=g)])
    held, run = [0], eng.runner.run

    def counting(batch):  # blocks in use while each step runs
        held[0] = max(held[0], eng.bm.num_used)
        return run(batch)

    eng.runner.run = counting
    eng.add([Request(1, pb, 4, min_tokens=4, sampling=SamplingParams(temperature=0.0)),
             Request(2, pc, 1, sampling=SamplingParams(temperature=0.0))])
    while eng.has_work():
        eng.step()
    assert eng.stats().prefix_cache_hit_tokens > 0  # pc did start on pa's blocks, later
    assert eng.stats().kv_blocks_peak == held[0] < 24


def test_set_max_batch_size_refuses_bools():
    eng = engine()
    for bad in (True, False, 2.0, 0):
        with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
            eng.set_max_batch_size(bad)
    assert type(eng.stats().max_batch_size) is int and eng.stats().max_batch_size == 8


def test_forced_lengths_and_eos():
    ps = prompts([3, 6, 9, 12], seed=1)
    def reqs(base, n_max, n_min):
        return [Request(sample_id=base + i, prompt_ids=p, max_tokens=n_max, min_tokens=n_min,
                        sampling=SamplingParams(temperature=1.0, seed=base + i)) for i, p in enumerate(ps)]

    # EOS := the token this model samples most often, so EOS comes early unless masked
    free_run = generate_all(engine(eos_ids=()), reqs(10, 40, 0))
    eos = int(torch.cat([s.output_ids for s in free_run]).bincount().argmax())
    eng = engine(eos_ids=(eos,))
    out = generate_all(eng, reqs(0, 30, 30) + reqs(10, 200, 4))
    for s in out[:4]:
        assert len(s.output_ids) == 30 and s.finish_reason == "length"
        assert eos not in s.output_ids.tolist()
    stops = [s for s in out[4:] if s.finish_reason == "stop"]
    assert len(stops) >= 2
    for s in out[4:]:
        ids = s.output_ids.tolist()
        assert len(ids) >= 4 and eos not in ids[:4]
        assert (s.finish_reason == "stop") == (eos in ids)
        if s.finish_reason == "stop":
            assert ids[-1] == eos and eos not in ids[:-1]
    assert all(torch.isfinite(s.logprobs).all() and (s.logprobs <= 0).all() for s in out)


def test_bad_requests_refused_and_others_served():
    good = greedy_requests(PS[:2], 4)
    bad = [
        Request(sample_id=100, prompt_ids=torch.zeros(0, dtype=torch.int64), max_tokens=4),
        Request(sample_id=101, prompt_ids=torch.zeros(256, dtype=torch.int64), max_tokens=4),
        Request(sample_id=102, prompt_ids=torch.tensor([1, V]), max_tokens=4),
        Request(sample_id=103, prompt_ids=torch.tensor([1, 2]), max_tokens=0),
        Request(sample_id=104, prompt_ids=torch.tensor([1, -1]), max_tokens=4),
        Request(sample_id=0, prompt_ids=torch.tensor([1, 2]), max_tokens=4),  # duplicate id in flight
    ]
    eng = engine()
    refused = eng.add(good + bad)
    why = {s.sample_id: s.error for s in refused}
    assert [s.finish_reason for s in refused] == ["error"] * 6 and len(why) == 6
    assert "empty prompt" in why[100]
    assert "does not fit the context" in why[101]
    assert f"token id {V} is outside the vocabulary" in why[102]
    assert why[102].startswith("request 4 (sample_id 102)")
    assert "max_tokens" in why[103]
    assert "token id -1" in why[104]
    assert "already queued" in refused[-1].error
    out = generate_all(eng, [])
    check_against_recompute(good, sorted(out, key=lambda s: s.sample_id))


def test_generate_all_returns_each_request_its_own_sample_when_an_id_repeats():
    # [ok, duplicate of ok] came back [error, length]: a caller zipping requests with results
    # gave the refusal to the request that was served (review, s54)
    empty = torch.zeros(0, dtype=torch.int64)
    reqs = [Request(7, PS[0], 3, 3, sampling=GREEDY), Request(7, PS[1], 3, 3, sampling=GREEDY),
            Request(8, empty, 3), Request(8, PS[2], 3, 3, sampling=GREEDY), Request(9, PS[3], 3, 3, sampling=GREEDY)]
    out = generate_all(engine(), reqs)
    assert [s.finish_reason for s in out] == ["length", "error", "error", "length", "length"]
    assert "already queued" in out[1].error and "empty prompt" in out[2].error
    check_against_recompute([reqs[0], reqs[3], reqs[4]], [out[0], out[3], out[4]])


def test_malformed_requests_refused_naming_the_field_and_others_served():
    """Refusals besides the ones above: prompt not a 1-D integer tensor, min_tokens outside
    [0, max_tokens] or not an int, bad sampling params, malformed fields (sampling not a
    SamplingParams, an unhashable sample id, a meta prompt, a non-int group). Each bad request
    gets an error Sample naming the field and the value; the good ones of the same call (boundary values included) are served
    exactly as when added alone."""
    good = [Request(sample_id=0, prompt_ids=PS[0], max_tokens=5, min_tokens=5, sampling=GREEDY),
            Request(sample_id=1, prompt_ids=PS[1], max_tokens=5, min_tokens=0,  # bounds: accepted
                    sampling=SamplingParams(temperature=0.0, top_p=1.0, top_k=V + 3)),
            Request(sample_id=2, prompt_ids=PS[2], max_tokens=5, min_tokens=5, sampling=GREEDY)]
    prompt_msg = "prompt_ids must be a 1-D integer tensor, got "
    ok = torch.tensor([1, 2])
    bad = [  # (request, its complaint)
        (Request(sample_id=100, prompt_ids=torch.tensor([[1, 2]]), max_tokens=4), prompt_msg + "shape (1, 2) torch.int64"),
        (Request(sample_id=101, prompt_ids=torch.tensor([1.0, 2.0]), max_tokens=4), prompt_msg + "shape (2,) torch.float32"),
        (Request(sample_id=102, prompt_ids=torch.tensor(3), max_tokens=4), prompt_msg + "shape () torch.int64"),
        (Request(sample_id=103, prompt_ids=[1, 2], max_tokens=4), prompt_msg + "list"),
        (Request(sample_id=104, prompt_ids=torch.tensor([1j, 2j]), max_tokens=4), prompt_msg + "shape (2,) torch.complex64"),
        (Request(sample_id=105, prompt_ids=ok, max_tokens=4, min_tokens=-1),
         "min_tokens must be in [0, max_tokens=4], got -1"),
        (Request(sample_id=106, prompt_ids=ok, max_tokens=4, min_tokens=5),
         "min_tokens must be in [0, max_tokens=4], got 5"),
        (Request(sample_id=107, prompt_ids=ok, max_tokens=4, min_tokens=1.5),
         "min_tokens must be in [0, max_tokens=4], got 1.5"),
        (Request(sample_id=108, prompt_ids=ok, max_tokens=4, min_tokens="1"),
         "min_tokens must be in [0, max_tokens=4], got '1'"),
        (Request(sample_id=109, prompt_ids=ok, max_tokens=4, sampling=SamplingParams(temperature=-0.5)),
         "sampling temperature must be a finite number >= 0, got -0.5"),
        (Request(sample_id=110, prompt_ids=ok, max_tokens=4, sampling=SamplingParams(top_p=0.0)),
         "sampling top_p must be in (0, 1], got 0.0"),
        (Request(sample_id=111, prompt_ids=ok, max_tokens=4, sampling=SamplingParams(top_p=1.5)),
         "sampling top_p must be in (0, 1], got 1.5"),
        (Request(sample_id=112, prompt_ids=ok, max_tokens=4, sampling=SamplingParams(top_p=float("nan"))),
         "sampling top_p must be in (0, 1], got nan"),
        (Request(sample_id=113, prompt_ids=ok, max_tokens=4, sampling=SamplingParams(top_k=-2)),
         "sampling top_k must be an int >= -1 (0 or -1: off), got -2"),
        (Request(sample_id=114, prompt_ids=ok, max_tokens=4, sampling=SamplingParams(temperature=float("nan"))),
         "sampling temperature must be a finite number >= 0, got nan"),  # would sample garbage with NaN log-probs
        (Request(sample_id=115, prompt_ids=ok, max_tokens=4, sampling=SamplingParams(top_k=2.5)),
         "sampling top_k must be an int >= -1 (0 or -1: off), got 2.5"),  # would crash step() for every request in flight
        # each of these raised out of add() part way, the requests after it never queued:
        (Request(sample_id=116, prompt_ids=ok, max_tokens=4, sampling=None),
         "sampling must be a SamplingParams, got NoneType None"),
        (Request(sample_id=117, prompt_ids=ok, max_tokens=4, sampling={"temperature": 0.5}),
         "sampling must be a SamplingParams, got dict {'temperature': 0.5}"),
        (Request(sample_id=[118], prompt_ids=ok, max_tokens=4), "sample_id must be an int, got list [118]"),
        (Request(sample_id=119, prompt_ids=torch.tensor([1, 2], device="meta"), max_tokens=4),
         "prompt_ids is on the meta device (no data)"),
        (Request(sample_id=120, prompt_ids=ok, max_tokens=4, group_id="g"),
         "group_id must be an int >= 0 (-1: no group), got 'g'"),
    ]
    # good requests first, between and last: refusals must not disturb their queueing
    reqs = [good[0]] + [r for r, _ in bad[:7]] + [good[1]] + [r for r, _ in bad[7:]] + [good[2]]
    eng = engine()
    refused = eng.add(reqs)
    assert [s.sample_id for s in refused] == [r.sample_id for r, _ in bad]
    for s, (r, msg) in zip(refused, bad):
        assert s.finish_reason == "error" and s.output_ids.numel() == 0 and s.logprobs.numel() == 0
        i = next(i for i, q in enumerate(reqs) if q is r)
        assert s.error == f"request {i} (sample_id {r.sample_id}): {msg}"
    assert eng.stats().waiting == 3
    out = sorted(generate_all(eng, []), key=lambda s: s.sample_id)
    alone = sorted(generate_all(engine(), good), key=lambda s: s.sample_id)
    assert [s.sample_id for s in out] == [0, 1, 2] and all(s.finish_reason != "error" for s in out)
    for a, b in zip(out, alone):
        assert a.output_ids.tolist() == b.output_ids.tolist() and a.finish_reason == b.finish_reason
        assert torch.equal(a.logprobs, b.logprobs)
    check_against_recompute([good[0], good[2]], [out[0], out[2]])


def test_add_takes_a_list_of_requests():
    eng = engine()
    ok = Request(sample_id=0, prompt_ids=PS[0], max_tokens=2)
    with pytest.raises(TypeError, match=r"add: requests\[1\] is a dict, not a Request"):
        eng.add([ok, {"sample_id": 1}])
    with pytest.raises(TypeError, match="add: expected a list of Request, got Request"):
        eng.add(ok)
    assert eng.stats().waiting == 0  # nothing queued before the refusal
    # a generator was consumed by the type check and nothing was queued, silently
    assert eng.add(Request(sample_id=i, prompt_ids=PS[i], max_tokens=2) for i in range(2)) == []
    assert eng.stats().waiting == 2


def test_lpt_admission_order():
    est = [3.0, 50.0, 10.0, 7.0, 50.0]
    reqs = [Request(sample_id=i, prompt_ids=PS[i], max_tokens=64, est_len=e, sampling=GREEDY)
            for i, e in enumerate(est)]
    for policy, want in (("lpt", [1, 4, 2, 3, 0]), ("fcfs", [0, 1, 2, 3, 4])):
        order = []
        generate_all(engine(max_batch_size=1, admission=policy), reqs, on_sample=lambda s: order.append(s.sample_id))
        assert order == want, policy


def test_max_batch_size_honoured_and_changeable():
    reqs = greedy_requests(prompts([4] * 10), 6)
    eng = engine(max_batch_size=3)
    eng.add(reqs)
    seen, got = [], []
    for _ in range(3):
        got += eng.step()
        seen.append(eng.stats().running)
    eng.set_max_batch_size(2)  # takes effect at once (extra sequences are preempted)
    assert eng.stats().running <= 2
    for _ in range(4):
        got += eng.step()
        seen.append(eng.stats().running)
    eng.set_max_batch_size(5)
    while eng.has_work():
        got += eng.step()
        seen.append(eng.stats().running)
    assert max(seen[:3]) == 3 and max(seen[3:7]) == 2 and max(seen[7:]) == 5
    assert eng.stats().max_batch_size == 5 and len(got) == 10
    with pytest.raises(ValueError, match="max_batch_size"):
        eng.set_max_batch_size(0)


def _cpu_kernel_or_skip():
    from workers.generation import cpu_attention

    extension_or_skip(cpu_attention, "C++ CPU attention kernel")


def groups_and_solos(solos) -> list[Request]:
    """Four GRPO-like groups of 3 (prompts of 7, 8, 13 and 1 tokens), then ``solos`` alone; 10
    greedy tokens each, ids in order."""
    ps = prompts([7, 8, 13, 1])
    group_of = [i // 3 for i in range(12)]
    reqs = greedy_requests([ps[g] for g in group_of], 10, group_of) + greedy_requests(solos, 10)
    for i, r in enumerate(reqs):
        r.sample_id = i
    return reqs


def test_cpu_kernel_backend_equals_recompute_with_sharing_and_preemption():
    _cpu_kernel_or_skip()
    reqs = groups_and_solos(PS[:4])
    eng = engine(attention_backend="cpu", kv_cache_tokens=96, max_batch_size=12)
    out = generate_all(eng, reqs)
    assert eng.stats().preemptions > 0
    check_against_recompute(reqs, out)


def test_cpu_kernel_decode_keeps_its_inputs_between_steps():
    # the decode inputs are updated in place between steps of the same batch (DecodeInputs)
    # and rebuilt when it changes; the tokens are the recomputation's either way
    _cpu_kernel_or_skip()
    reqs = greedy_requests(PS, 14)
    eng = engine(attention_backend="cpu", max_batch_size=8)
    eng.add(reqs)
    out, steps = [], 0
    while eng.has_work():
        out += eng.step()
        steps += 1
    out.sort(key=lambda s: s.sample_id)
    check_against_recompute(reqs, out)
    assert 1 <= eng.runner.decode_inputs.rebuilds <= steps // 3, (eng.runner.decode_inputs.rebuilds, steps)


def test_a_live_group_keeps_its_prompt():
    # GRPO groups share one prompt (and its cached prefix): a new prompt under a live group id
    # is refused (it used to deadlock the prefix cache's eviction); once the group is done,
    # the id is free again
    a, b = PS[0], PS[1]
    eng = engine()
    first = Request(sample_id=0, prompt_ids=a, max_tokens=4, min_tokens=4, sampling=GREEDY, group_id=7)
    other = Request(sample_id=1, prompt_ids=b, max_tokens=4, min_tokens=4, sampling=GREEDY, group_id=7)
    same = Request(sample_id=2, prompt_ids=a.clone(), max_tokens=4, min_tokens=4, sampling=GREEDY, group_id=7)
    refused = eng.add([first, other, same])
    assert [s.sample_id for s in refused] == [1]
    assert refused[0].error == ("request 1 (sample_id 1): group_id 7 is live with another prompt (the samples "
                                "of a group share one prompt, and its cached prefix)")
    out = generate_all(eng, [])
    assert sorted(s.sample_id for s in out) == [0, 2]
    check_against_recompute([first, same], sorted(out, key=lambda s: s.sample_id))
    again = generate_all(eng, [Request(sample_id=3, prompt_ids=b, max_tokens=3, sampling=GREEDY, group_id=7)])
    assert again[0].finish_reason != "error" and len(again[0].output_ids) == 3
    assert eng.stats().kv_blocks_used == 0 and not eng.prefix.groups


def test_a_near_zero_temperature_is_greedy():
    # logits / 1e-45 overflow in fp32: below 1e-5 (vLLM's bound) the row is greedy
    reqs = [Request(sample_id=i, prompt_ids=PS[0], max_tokens=5, min_tokens=5,
                    sampling=SamplingParams(temperature=t)) for i, t in enumerate((0.0, 1e-45, 1e-6))]
    out = generate_all(engine(), reqs)
    assert out[1].output_ids.tolist() == out[2].output_ids.tolist() == out[0].output_ids.tolist()
    assert all(torch.isfinite(s.logprobs).all() for s in out)
    torch.testing.assert_close(out[1].logprobs, out[0].logprobs)


def test_an_engine_needs_two_blocks():
    with pytest.raises(ValueError, match=r"engine.num_blocks: must give at least two blocks of 16 tokens, got 1"):
        EngineConfig(device="cpu", block_size=16, num_blocks=1)
    with pytest.raises(ValueError, match=r"engine.kv_cache_tokens: must give at least two blocks"):
        EngineConfig(device="cpu", block_size=16, kv_cache_tokens=31)
    EngineConfig(device="cpu", block_size=16, kv_cache_tokens=32)

