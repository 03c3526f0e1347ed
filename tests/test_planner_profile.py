"""profile_engine on the real native engine (tiny random model, CPU).

Wall-clock numbers are never asserted: the measuring logic is checked with a step-counting
clock (each engine step "costs" 10 ms + 1 ms per running sequence), so the recovered PTL(BS)
must equal that law exactly; the real clock is only checked for shape."""
import numpy as np
import pytest
import torch

from controller.planner.profile import (TrainerPasses, TrainProfile, fit_train_profile, profile_engine,
                                        profile_trainer)
from controller.scheduling import PTLProfile
from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.model import CausalLM, ModelConfig, init_weights


def tiny_engine(kv_tokens=2048, max_batch_size=16, max_prefill_tokens=8192):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    model = init_weights(CausalLM(cfg), seed=0)
    ecfg = EngineConfig(max_batch_size=max_batch_size, block_size=16, kv_cache_tokens=kv_tokens, device="cpu",
                        dtype="float32", prefix_sharing=False, max_prefill_tokens=max_prefill_tokens)
    return NativeEngine(ecfg, model=model)


class StepClock:
    """Wraps an engine; a virtual clock advances by a + b * running + c * cached KV tokens
    (blocks in use x 16) + p * prompt tokens prefilled, on every step."""

    def __init__(self, engine, a=0.01, b=0.001, c=0.0, p=0.0):
        self.engine, self.a, self.b, self.c, self.p, self.t = engine, a, b, c, p, 0.0
        self.cfg = engine.cfg

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        st = self.engine.stats()
        sch = self.engine.scheduler
        seqs = list(sch.running) + list(sch.waiting)
        before = [s.num_cached for s in seqs]
        out = self.engine.step()
        prefilled = sum(max(0, min(s.num_cached, s.prompt_len) - b) for s, b in zip(seqs, before))
        self.t += self.a + self.b * st.running + self.c * st.kv_blocks_used * 16 + self.p * prefilled
        return out

    def clock(self):
        return self.t


def test_profile_recovers_the_step_law_and_leaves_the_engine_idle():
    torch.set_num_threads(1)
    eng = StepClock(tiny_engine(), p=1e-4)
    prof = profile_engine(eng, batch_sizes=(1, 2, 4, 8), prompt_len=8, decode_steps=4, warmup_steps=1,
                          clock=eng.clock, name="tiny")
    assert prof.batch_sizes == [1, 2, 4, 8]
    assert prof.ptl_s == pytest.approx([0.01 + 0.001 * b for b in (1, 2, 4, 8)])
    assert prof.kv_s_per_token == 0.0
    assert prof.kv_tokens == 2048 and prof.block_size == 16 and prof.max_batch_size == 16
    # a prefill step runs alone (nothing else running): a + p * prompt tokens
    assert prof.prefill_s_per_token == pytest.approx(1e-4) and prof.prefill_step_s == pytest.approx(0.01)
    assert not eng.engine.has_work() and eng.engine.stats().max_batch_size == 16
    assert prof.max_batch_for_len(200) == 2048 // 208  # KV-bound: 9 sequences of 13 blocks
    assert prof.max_batch_for_len(10) == 16  # bound by the engine's max_batch_size


def test_the_prefill_probes_compute_their_prompts_not_the_prefix_cache():
    # every probe drew the same prompt ids (one seed), so with prefix caching on (the default) the
    # long prefill probe found the short one's blocks and timed a few tokens (review, session 47)
    torch.set_num_threads(1)
    eng = StepClock(tiny_engine(), p=1e-4)
    prof = profile_engine(eng, batch_sizes=(1, 2), prompt_len=40, decode_steps=2, warmup_steps=1, clock=eng.clock)
    assert eng.engine.stats().prefix_cache_hit_tokens == 0
    assert prof.prefill_s_per_token == pytest.approx(1e-4) and prof.prefill_step_s == pytest.approx(0.01)


@pytest.mark.parametrize("prompt_len", [40, 100])
def test_the_prefill_probes_fit_one_step_of_chunked_prefill(prompt_len):
    # a probe longer than max_prefill_tokens is prefilled in chunks: timing its first step gave the
    # per-token cost of one chunk (1/5 of the truth here) and a wrong fixed cost (review, s54)
    torch.set_num_threads(1)
    eng = StepClock(tiny_engine(max_prefill_tokens=64), p=1e-4)
    prof = profile_engine(eng, batch_sizes=(1, 2), prompt_len=prompt_len, decode_steps=2, warmup_steps=1,
                          clock=eng.clock)
    assert prof.prefill_s_per_token == pytest.approx(1e-4) and prof.prefill_step_s == pytest.approx(0.01)
    assert prof.meta["prefill_probe_tokens"] == ([40, 64] if prompt_len == 40 else [16, 64])


def test_profile_recovers_the_cost_per_cached_token():
    torch.set_num_threads(1)
    eng = StepClock(tiny_engine(kv_tokens=4096), c=1e-5)
    prof = profile_engine(eng, batch_sizes=(1, 2, 4, 8), prompt_len=8, decode_steps=4, warmup_steps=1,
                          clock=eng.clock, long_context=200)
    assert prof.kv_s_per_token == pytest.approx(1e-5, rel=0.15)  # block rounding
    assert prof.ref_context == 8 + 1 + 2


def test_profile_keeps_the_long_prefill_probe_inside_the_context():
    # the long prefill probe (4 x prompt_len) was refused past max_model_len (512 here), and
    # the empty step timed in its place gave a prefill cost of 0
    torch.set_num_threads(1)
    eng = StepClock(tiny_engine(kv_tokens=4096), p=1e-4)
    prof = profile_engine(eng, batch_sizes=(1, 2), prompt_len=200, decode_steps=4, warmup_steps=1,
                          clock=eng.clock)
    assert prof.prefill_s_per_token == pytest.approx(1e-4) and prof.prefill_step_s == pytest.approx(0.01)
    assert not eng.engine.has_work()


def test_profile_with_the_real_clock_is_reusable(tmp_path):
    torch.set_num_threads(1)
    eng = tiny_engine()
    prof = profile_engine(eng, batch_sizes=(1, 4), prompt_len=4, decode_steps=3, warmup_steps=1)
    # the measured (raw) per-step seconds, and the profile as their running maximum
    raw = prof.meta["raw_ptl_s"]
    assert len(raw) == 2 and all(r > 0 for r in raw)
    assert prof.ptl_s == [raw[0], max(raw)]
    assert prof.meta["source"] == "measured" and prof.batch_sizes == [1, 4]
    prof.save(tmp_path / "ptl.json")
    assert PTLProfile.load(tmp_path / "ptl.json") == prof


def test_profile_draws_prompt_ids_the_model_can_embed():
    """vocab above the model's (64 here) is lowered to it: bench/planner code passes 300 for
    any model, and an in-process BPE may hold fewer tokens than that."""
    torch.set_num_threads(1)
    eng = StepClock(tiny_engine())
    prof = profile_engine(eng, batch_sizes=(1, 2), prompt_len=8, decode_steps=2, warmup_steps=1,
                          clock=eng.clock, vocab=300)
    assert prof.batch_sizes == [1, 2] and not eng.engine.has_work()


def test_profile_refuses_what_cannot_fit():
    eng = tiny_engine(kv_tokens=256)
    with pytest.raises(ValueError, match="batch size 32 x 16 tokens needs 512 KV tokens, the engine has 256"):
        profile_engine(eng, batch_sizes=(1, 32), prompt_len=8, decode_steps=4, warmup_steps=2)


def test_profile_trainer_fits_a_line():
    t = {"now": 0.0}

    def train(tokens):  # virtual clock: 0.2 s + 1 ms per token
        t["now"] += 0.2 + 0.001 * tokens

    prof = profile_trainer(train, token_counts=(100, 400, 900), repeats=1, clock=lambda: t["now"])
    assert prof.s_per_token == pytest.approx(0.001) and prof.fixed_s == pytest.approx(0.2)
    assert prof.time(1000, ranks=2) == pytest.approx(0.2 + 0.5)
    with pytest.raises(ValueError, match="at least 2 distinct token_counts"):
        profile_trainer(train, token_counts=(5, 5))
    assert TrainProfile(1e-3).source == "measured"


@pytest.mark.parametrize("kw, said", [({"s_per_token": float("nan")}, r"\{'s_per_token': nan\} must be finite"),
                                      ({"s_per_token": 1e-3, "fixed_s": float("inf")}, r"\{'fixed_s': inf\}"),
                                      ({"s_per_token": -1.0}, r"\{'s_per_token': -1.0\}"),
                                      ({"s_per_token": "1e-3"}, r"\{'s_per_token': '1e-3'\}"),
                                      ({"s_per_token": 1e-3, "ranks": 2.5}, r"ranks must be an int >= 1, got 2.5"),
                                      ({"s_per_token": 1e-3, "ranks": 0}, r"ranks must be an int >= 1, got 0")])
def test_a_train_profile_is_finite_numbers(kw, said):
    # NaN/inf (a JSON file may hold NaN) passed and made every planner time NaN/inf; PTLProfile refuses them
    with pytest.raises(ValueError, match="TrainProfile: " + said):
        TrainProfile(**kw)
    assert TrainProfile(0.0, 0.0, np.int64(2)).ranks == 2  # free training and numpy ints are fine


def test_profile_trainer_takes_the_median_pass():
    """A run pays its typical pass: one fast outlier among three must not set the profile."""
    t = {"now": 0.0, "calls": 0}

    def train(tokens):  # every third pass at each size is 2x faster than the other two
        t["calls"] += 1
        t["now"] += (0.2 + 0.001 * tokens) * (0.5 if t["calls"] % 3 == 1 else 1.0)

    prof = profile_trainer(train, token_counts=(100, 900), repeats=3, clock=lambda: t["now"])
    assert prof.s_per_token == pytest.approx(0.001) and prof.fixed_s == pytest.approx(0.2)
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_trainer(train, token_counts=(100, 900), repeats=0)
    # passes pooled from two sessions (before and after a run): the median per size
    pooled = fit_train_profile({100: [0.3, 0.35, 0.9], 900: [1.1, 1.0, 1.3, 1.1]})
    assert pooled.s_per_token == pytest.approx(0.75 / 800) and pooled.fixed_s == pytest.approx(0.35 - 0.075 * 100 / 80)
    with pytest.raises(ValueError, match="at >= 2 distinct token counts"):
        fit_train_profile({100: [0.3]})


def test_trainer_passes_pool_samples_taken_at_different_moments():
    """Warm-up passes are not timed; a sample before and one after a run are pooled per size."""
    t = {"now": 0.0, "speed": 1.0, "calls": []}

    def train(tokens):
        t["calls"].append(tokens)
        t["now"] += (0.02 + 0.0001 * tokens) * t["speed"]

    tp = TrainerPasses(train, [200, 400, 600, 800], warmup=2, repeats=1, clock=lambda: t["now"])
    assert t["calls"] == [800, 800] and tp.sizes == [200, 400, 600, 800] and tp.passes == {}
    tp.sample()
    t["speed"] = 3.0  # the host slows down for the second sample, then recovers for a third
    tp.sample()
    t["speed"] = 1.0
    tp.sample()
    assert all(len(v) == 3 for v in tp.passes.values())
    prof = tp.profile()  # the median per size is the normal-speed pass
    assert prof.s_per_token == pytest.approx(0.0001) and prof.fixed_s == pytest.approx(0.02)


def test_profile_counts_kv_in_the_engines_own_blocks():
    """An engine whose blocks are not its config's (vLLM's CPU blocks are 32 tokens whatever
    block_size asks) says so with ``block_size``: its stats' blocks are counted in those (the
    profile saw half the cache and refused sizes that fit). Here the native engine's 16-token
    blocks, as the engine reports them, against a config saying 8."""
    from dataclasses import replace

    eng = StepClock(tiny_engine(kv_tokens=512))  # (a wrapper: the engine itself keeps its config)
    eng.block_size = 16
    eng.cfg = replace(eng.cfg, block_size=8)  # what a config asked; the engine's blocks are 16
    prof = profile_engine(eng, batch_sizes=(1, 16), prompt_len=8, decode_steps=4, warmup_steps=2, clock=eng.clock)
    assert prof.kv_tokens == 512 and prof.block_size == 16


def test_ptl_profile_step_time_and_extrapolation():
    p = PTLProfile([1, 8, 16], [1.0, 2.0, 1.9], kv_tokens=10**6)
    assert p.ptl(64) == pytest.approx(1.9)  # a falling last segment extends flat, never towards 0
    q = PTLProfile([1, 4], [1.0, 2.0], kv_tokens=10**6, kv_s_per_token=0.01, ref_context=100.0)
    assert q.step_time(4, 400) == pytest.approx(2.0)  # measured at ref_context tokens a sequence
    assert q.step_time(4, 500) == pytest.approx(3.0)
    assert q.step_time(4, 0) == pytest.approx(1.0)  # fewer cached tokens: at most half the step
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        PTLProfile([1], [1.0], kv_tokens=10, kv_s_per_token=-1e-3)
