"""NativeEngine used as a vLLM user would: sampling-parameter edge values (vLLM's meanings),
the returned log-probs against a brute-force recomputation of the processed distribution,
context-limit boundaries, prefix sharing at a block boundary, EOS ids checked at
construction, ``stats().tokens_per_s`` of an idle engine."""
import time

import pytest
import torch
from test_engine import GREEDY, MODEL, V, engine, prompts, recompute_greedy

from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.generation.token_rate import TokenRate
from workers.generation.factory import make_engine
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained
from workers.types import Request, SamplingParams

torch.set_num_threads(1)
PS = prompts([3, 7, 12, 5, 9], seed=3)


def test_top_k_minus_one_is_off_as_in_vllm():
    # vLLM "quietly accepts -1 as disabled" (its default for years); the controller maps it,
    # a direct caller got every such request refused. -2 is still refused.
    def run(top_k):
        req = Request(sample_id=0, prompt_ids=PS[1], max_tokens=8, min_tokens=8,
                      sampling=SamplingParams(temperature=1.0, top_k=top_k, seed=11))
        return generate_all(engine(), [req])[0]

    off = run(0)
    assert off.finish_reason == "length"
    for k in (-1, V, V + 5):
        s = run(k)
        assert s.finish_reason == "length", (k, s.error)
        assert s.output_ids.tolist() == off.output_ids.tolist() and torch.equal(s.logprobs, off.logprobs)
    bad = run(-2)
    assert bad.finish_reason == "error" and "top_k must be an int >= -1 (0 or -1: off), got -2" in bad.error


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token_as_vllm():
    """A top_p below ~1.4e-45 is 0 in float32: every token was dropped, the log-probs were NaN
    and the draw took the last vocabulary id (review, session 50); vLLM keeps the top token."""
    def run(sp):
        return generate_all(engine(), [Request(0, PS[1], 5, 5, sampling=sp)])[0]

    tiny = run(SamplingParams(temperature=1.0, top_p=1e-300, seed=1))
    top1 = run(SamplingParams(temperature=1.0, top_k=1, seed=1))
    assert tiny.finish_reason == "length" and torch.equal(tiny.logprobs, torch.zeros(5))
    assert tiny.output_ids.tolist() == top1.output_ids.tolist()


@torch.no_grad()
def _processed_logprobs(prompt, out, sp, eos, min_tokens):
    """Brute force, in float64: the log-prob of each output token under the distribution it
    was drawn from (vLLM's "processed_logprobs"): EOS masked below min_tokens, then (sampled
    rows) logits / T, top-k, top-p; greedy rows at T = 1."""
    seq, lps = prompt.clone(), []
    for j, t in enumerate(out):
        lg = MODEL.forward_packed([seq])[-1].double()
        if j < min_tokens:
            lg[list(eos)] = float("-inf")
        if sp.temperature >= 1e-5:
            lg = lg / sp.temperature
            if 0 < sp.top_k < V:
                lg[lg < lg.topk(sp.top_k).values[-1]] = float("-inf")
            if sp.top_p < 1:
                srt, idx = lg.softmax(-1).sort(descending=True)
                lg[idx[(srt.cumsum(0) - srt) >= sp.top_p]] = float("-inf")
        lps.append(float(lg.log_softmax(-1)[t]))
        seq = torch.cat([seq, torch.tensor([t])])
    return torch.tensor(lps, dtype=torch.float64)


def test_logprobs_are_the_processed_distribution_end_to_end():
    eos = (5, 7)  # two EOS ids, both masked below min_tokens
    kinds = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1), SamplingParams(temperature=1.3, seed=2),
             SamplingParams(temperature=0.5, top_p=0.6, seed=3), SamplingParams(temperature=0.0),
             SamplingParams(temperature=2.0, top_k=3, seed=4)]
    reqs = [Request(sample_id=i, prompt_ids=PS[i], max_tokens=12, min_tokens=4, sampling=sp)
            for i, sp in enumerate(kinds)]
    out = generate_all(engine(eos_ids=eos, max_batch_size=3), reqs)
    for r, s in zip(reqs, out):
        want = _processed_logprobs(r.prompt_ids, s.output_ids.tolist(), r.sampling, eos, 4)
        assert torch.isfinite(want).all()  # no token drawn from outside its filtered set
        torch.testing.assert_close(s.logprobs.double(), want, atol=1e-4, rtol=0)


def test_context_limit_boundaries():
    eng = engine(max_model_len=20)
    p10, p19, p20 = (prompts([n], seed=n)[0] for n in (10, 19, 20))
    exact = Request(sample_id=0, prompt_ids=p10, max_tokens=10, sampling=GREEDY)  # 10 + 10 == 20
    over = Request(sample_id=1, prompt_ids=p10, max_tokens=11, min_tokens=11, sampling=GREEDY)  # one over
    last = Request(sample_id=2, prompt_ids=p19, max_tokens=5, sampling=GREEDY)  # room for one token
    full = Request(sample_id=3, prompt_ids=p20, max_tokens=1, sampling=GREEDY)  # no room: refused
    out = {s.sample_id: s for s in generate_all(eng, [exact, over, last, full])}
    assert [len(out[i].output_ids) for i in range(3)] == [10, 10, 1]
    assert all(out[i].finish_reason == "length" for i in range(3))
    assert out[0].output_ids.tolist() == recompute_greedy(MODEL, p10, 10)[0] == out[1].output_ids.tolist()
    assert out[3].finish_reason == "error" and "does not fit the context" in out[3].error


def test_a_configured_context_the_cache_cannot_hold_is_refused():
    # as vLLM, which refuses to start; it was cut silently to the cache, and prompts were then
    # refused naming a max_model_len the user never set
    with pytest.raises(ValueError, match=r"engine.max_model_len: 512 tokens do not fit the KV cache, whose 16 "
                                         r"blocks of 4 tokens hold at most 60 tokens of one sequence"):
        engine(max_model_len=512, kv_cache_tokens=64)
    assert engine(max_model_len=60, kv_cache_tokens=64).max_model_len == 60
    assert engine(kv_cache_tokens=64).max_model_len == 60  # the model's own context: cut to the cache



def test_a_configured_context_past_the_models_is_refused():
    # MODEL's max_position_embeddings is 256: 1000 was cut to 256 silently (vLLM refuses to start;
    # engine review, s60); the model's own context and a shorter one are taken
    with pytest.raises(ValueError, match=r"^engine.max_model_len: 1000 is past the model's context "
                                         r"\(max_position_embeddings 256 in its config.json\); set it to at most 256"):
        engine(max_model_len=1000)
    with pytest.raises(ValueError, match=r"^engine.max_model_len: 257 is past the model's context"):
        engine(max_model_len=257)  # one past (mutation review, s60)
    assert engine(max_model_len=256).max_model_len == 256 and engine().max_model_len == 256
    assert engine(max_model_len=100).max_model_len == 100


def test_a_cache_that_holds_no_output_token_is_refused():
    """One-token blocks, two of them: every prompt was refused ("max_model_len 1") at run time."""
    with pytest.raises(ValueError, match=r"engine.num_blocks: must hold a sequence of 2 tokens .* 2 blocks of 1 "
                                         r"hold 1, got 2"):
        EngineConfig(block_size=1, num_blocks=2)
    with pytest.raises(ValueError, match="engine.max_model_len: must be 0 .* or >= 2"):
        EngineConfig(max_model_len=1)
    assert EngineConfig(block_size=1, num_blocks=3).kv_len == 2


@pytest.mark.parametrize("plen", [4, 8, 5])
def test_group_prompt_at_a_block_boundary_with_different_output_lengths(plen):
    # prompts of exactly 1 and 2 blocks (the copy-on-write block is the last pinned one) and
    # one not; the samples of a group stop at different lengths
    p = prompts([plen], seed=plen)[0]
    reqs = [Request(sample_id=i, prompt_ids=p, max_tokens=2 + 5 * i, min_tokens=2 + 5 * i, sampling=GREEDY,
                    group_id=0) for i in range(4)]
    eng = engine(block_size=4)
    out = generate_all(eng, reqs)
    for r, s in zip(reqs, out):
        assert s.output_ids.tolist() == recompute_greedy(MODEL, p, r.max_tokens)[0]
    assert eng.stats().kv_blocks_used == 0 and not eng.prefix.groups


def test_eos_ids_outside_the_vocabulary_refused_at_construction(tmp_path):
    # the sampler masks EOS columns below min_tokens: such an id used to fail the first step
    # with min_tokens (every request in flight) instead of the construction
    with pytest.raises(ValueError, match=r"engine\.eos_ids: \[100\] outside the model's vocabulary \[0, 97\)"):
        NativeEngine(EngineConfig(block_size=4, kv_cache_tokens=64, eos_ids=(3, V + 3)), model=MODEL)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=3)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    for backend in ("native", "vllm"):  # vLLM: checked before vLLM is imported (runs without it)
        with pytest.raises(ValueError, match=r"engine\.eos_ids: \[64\]"):
            make_engine(EngineConfig(backend=backend, device="cpu"), str(tmp_path / "m"), eos_ids=[64])


def test_token_rate_window():
    r = TokenRate()
    for t, n in [(0.0, 5), (1.0, 10), (2.0, 10)]:
        r.add(t, n)
    assert r.rate(2.0) == 10.0  # 20 tokens after the first step, in 2 s
    assert r.rate(4.0) == 5.0  # idle for 2 s: the rate falls
    assert r.rate(6.5) == pytest.approx(10 / 5.5) and len(r.window) == 2  # trimmed
    assert r.rate(7.0) == 0.0 and len(r.window) == 1  # no step in the last 5 s
    r.add(8.0, 4, started=7.5)  # steps again: the span starts with this step, not at t = 2
    assert r.rate(8.0) == pytest.approx(4 / 0.5)  # used to read 4 / 6: the pause counted
    r.add(8.5, 4, started=8.0)
    assert r.rate(8.5) == pytest.approx(8 / 1.0)
    assert TokenRate().rate(1.0) == 0.0


def test_token_rate_counts_the_first_step_from_its_start():
    r = TokenRate()
    r.add(1.0, 64, started=0.5)
    assert r.rate(1.0) == pytest.approx(128.0)
    r = TokenRate()
    r.add(1.0, 64)  # no start known: the step only marks where the span begins
    r.add(1.5, 64)
    assert r.rate(1.5) == pytest.approx(128.0)
    r.add(10.0, 8)  # after a pause, without a start: a new span, nothing counted yet
    assert r.rate(10.0) == 0.0 and len(r.window) == 1


def test_token_rate_running_sum_equals_the_sum_over_its_window():
    r, g = TokenRate(horizon=3.0), torch.Generator().manual_seed(0)
    t = 0.0
    for _ in range(2000):
        t += float(torch.rand(1, generator=g)) * 0.05 + (2.5 if torch.rand(1, generator=g) < 0.01 else 0.0)
        r.add(t, int(torch.randint(0, 64, (1,), generator=g)))
        want = sum(n for _, n in list(r.window)[1:]) / (t - r.window[0][0]) if t > r.window[0][0] else 0.0
        assert r.rate(t) == pytest.approx(want)


def test_tokens_per_s_of_an_idle_engine_falls_to_zero(monkeypatch):
    eng = engine()
    generate_all(eng, [Request(sample_id=i, prompt_ids=PS[i], max_tokens=6, min_tokens=6, sampling=GREEDY)
                       for i in range(2)])
    assert eng.stats().tokens_per_s > 0
    later = time.time() + 6.0
    monkeypatch.setattr(time, "time", lambda: later)
    assert eng.stats().tokens_per_s == 0.0  # used to report the last rate for ever


def test_tokens_per_s_after_an_idle_period_is_the_new_steps_rate(monkeypatch):
    """The first steps after a pause used to be divided by the pause (a rate ~0 for 5 s)."""
    eng = engine()
    reqs = lambda base: [Request(sample_id=base + i, prompt_ids=PS[i], max_tokens=4, min_tokens=4,
                                 sampling=GREEDY) for i in range(2)]
    generate_all(eng, reqs(0))
    clock = [time.time() + 60.0]  # a minute later, each step takes 0.1 s on this clock
    def tick():
        clock[0] += 0.05
        return clock[0]
    monkeypatch.setattr(time, "time", tick)
    eng.add(reqs(10))
    eng.step()  # prefill: 2 tokens in 0.1 s (start and end each advance the clock by 0.05)
    assert eng.stats().tokens_per_s == pytest.approx(2 / 0.1, rel=0.5)


def test_an_engine_over_a_callers_model_leaves_its_training_flags_alone():
    """``NativeEngine(cfg, model=m)`` used to freeze ``m`` (requires_grad off, eval mode): a
    trainer handing its model to an engine would silently stop learning."""
    from test_engine import tiny_model
    model = tiny_model().train()
    eng = engine(model)
    assert all(p.requires_grad for p in model.parameters()) and model.training
    req = Request(sample_id=0, prompt_ids=PS[2], max_tokens=5, min_tokens=5, sampling=GREEDY)
    [s] = generate_all(eng, [req])
    assert s.output_ids.tolist() == recompute_greedy(model, PS[2], 5)[0]
    assert all(p.requires_grad for p in model.parameters()) and model.training


def test_the_engine_line_points_a_cpu_run_at_the_faster_attention_backend():
    # a user-journey review: runs on "auto" took the torch path on CPUs without a word
    hint = "attention torch (engine.attention_backend: cpu is faster on CPUs, docs/config.md)"
    assert hint in repr(NativeEngine(EngineConfig(block_size=4, kv_cache_tokens=64, device="cpu"), model=MODEL))
    chosen = repr(NativeEngine(EngineConfig(block_size=4, kv_cache_tokens=64, device="cpu",
                                            attention_backend="torch"), model=MODEL))
    assert "attention torch, " in chosen and "faster" not in chosen  # set on purpose: no advice


def test_a_top_p_of_one_keeps_every_token_beside_a_row_that_filters():
    """A row's float32 cumsum reaches 1.0 before a 151,936-token tail: with another row of the
    batch asking top_p < 1, the test ``mass before >= 1.0`` dropped ~99k tokens of the top_p 1
    row (review, session 51): its distribution depended on its batch mates. vLLM drops none."""
    from workers.generation.sampler import Sampler

    v = 151936
    logits = torch.randn(2, v, generator=torch.Generator().manual_seed(0)) * 3
    logits[:, 0] += 25  # a confident next token
    off, on = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)
    alone = Sampler._filtered_logprobs(logits[:1].clone(), [off], [False])[0]
    beside = Sampler._filtered_logprobs(logits.clone(), [off, on], [False, False])[0]
    assert not torch.isinf(alone).any() and torch.equal(beside, alone)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_seeds_2_to_the_32_apart_draw_differently(backend):
    """torch's CPU generator keeps a seed's low 32 bits: seeds 2**32 apart gave the same samples
    (review, session 51). A seed below 2**32 draws as before."""
    from workers.generation.sampler import generator

    seeds = [12345, 12345 + (1 << 32), 12345 + (7 << 40)]
    reqs = [Request(i, PS[1], 16, 16, sampling=SamplingParams(temperature=1.0, seed=s)) for i, s in enumerate(seeds)]
    outs = {tuple(s.output_ids.tolist()) for s in generate_all(engine(attention_backend=backend), reqs)}
    assert len(outs) == 3
    assert torch.equal(torch.rand(4, generator=generator("cpu", 12345)),
                       torch.rand(4, generator=torch.Generator().manual_seed(12345)))
