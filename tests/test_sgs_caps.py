"""The batch caps the SGS plans and the instances run with (review, session 51): a one-sequence
engine's default profile, a round's cap kept to its round, and dispatch planned on estimates a
request can reach."""
import math

import pytest
import torch

from controller.config import from_dict
from controller.length_estimates import within_run_bounds
from controller.scheduling import make_dispatcher
from controller.sgs import SGS, InstanceSlot, default_profile, dispatch_estimates
from controller.world import _profile
from workers.types import Request, SamplingParams

from runtime_helpers import tiny_model  # noqa: F401  (session-wide tiny model folder)


def test_an_engine_of_one_sequence_gets_a_profile():
    """engine.max_batch_size 1 passed every config check, then its default profile ([1, 1]:
    sizes must increase) stopped the run at start and refused every joiner."""
    cfg = from_dict({"engine": {"max_batch_size": 1, "kv_cache_tokens": 4096, "device": "cpu"},
                     "placement": {"generation": [1], "trainer": [2]}}, world_size=3)
    prof = _profile(cfg)
    assert prof.max_batch_size == 1 and prof.batch_sizes == [1]
    assert default_profile(64).batch_sizes == [1, 64]


def test_a_rounds_batch_cap_ends_with_the_round(tiny_model, monkeypatch):  # noqa: F811
    """A round's cap (a re-dispatch of one request: 1) stayed on the engine: the evaluations and
    the ranker's length measurements after it decoded one sequence at a time."""
    import controller.instance as instance
    from workers.generation.config import EngineConfig

    class NoTrainers:  # only the engine is looked at here
        def __init__(self, *a, **k):
            pass

        def put(self, s):
            pass

        def close(self):
            pass

    torch.set_num_threads(1)
    monkeypatch.setattr(instance, "Outbox", NoTrainers)
    inst = instance.GenerationInstance(1, EngineConfig(device="cpu", kv_cache_tokens=1024, max_batch_size=8),
                                       tiny_model, [0])

    def req(i):
        return Request(i, torch.tensor([1, 2, 3, 4]), 4, 4, 0.0, sampling=SamplingParams(temperature=0.0, seed=i))

    inst.generate(0, [req(0)], 0, batch_cap=1)
    assert inst.engine.stats().max_batch_size == 8
    caps, set_cap = [], inst.engine.set_max_batch_size
    monkeypatch.setattr(inst.engine, "set_max_batch_size", lambda n: (caps.append(n), set_cap(n)))
    inst.generate(1, [req(1)], 0, batch_cap=64)  # a dispatch.profile's cap past engine.max_batch_size
    assert caps == [8, 8]  # held to it (the profile lifted the engine past it: review, session 51)
    monkeypatch.undo()
    monkeypatch.setattr(instance, "Outbox", NoTrainers)
    running, step = [], inst.engine.step

    def counting_step():
        out = step()
        running.append(len(inst.engine.scheduler.running) + len(out))
        return out

    monkeypatch.setattr(inst.engine, "step", counting_step)
    inst.evaluate([req(100 + i) for i in range(6)], newest=True)
    assert max(running) == 6


def test_dispatch_plans_on_estimates_within_the_runs_bounds_never_a_requests_forced_length():
    """A ranker loaded from ranker.path predicts its trace's scale (docs/ranker.md: its order is
    what counts): estimates of 300-1540 tokens for 16-token requests made skew_paper cap the
    instances at 2 and 4 sequences where their KV holds every request at once. The program bounds
    them by train.max_tokens; a request's own bounds are not used: under train.length_trace they
    are its true length, and skew planned as the oracle (review, s60)."""
    asked = {}

    class Handle:
        def __init__(self, rank):
            self.rank, self.role, self.name, self.alive = rank, "generation", f"worker{rank}", True

        def call(self, method, iteration, chunk, version, cap, window):
            asked[self.rank] = (len(chunk), cap)

    sgs = SGS(make_dispatcher("skew_paper"), received=lambda it: set())
    sgs.slots = [InstanceSlot(Handle(r), default_profile(64, 4096, 16)) for r in (1, 2)]
    sgs.est_bounds = (0, 16)  # (train.min_tokens, train.max_tokens), as Program sets them
    reqs = [Request(i, torch.arange(8), 16, 0, float(300 + 40 * i)) for i in range(32)]
    assert dispatch_estimates(reqs, sgs.est_bounds) == [16.0] * 32
    sgs.launch(0, reqs, 0)
    assert sorted(asked) == [1, 2] and all(cap >= n for n, cap in asked.values()), asked
    assert within_run_bounds([0.0, 3.0, 12.0, 500.0, math.nan], 8, 16) == [8.0, 8.0, 12.0, 16.0, 8.0]
    assert within_run_bounds([0.0, 0.5], 0, 16) == [1.0, 1.0]  # within the run: no output is shorter than 1
    forced = [Request(i, torch.arange(8), n, n, e) for i, (n, e) in enumerate([(40, 5.0), (3, 30.0), (12, 12.0)])]
    assert dispatch_estimates(forced, (0, 64)) == [5.0, 30.0, 12.0]  # not 40, 3, 12


@pytest.mark.parametrize("saved_cap", [0, 64])
def test_a_dispatch_profile_keeps_the_engines_batch_cap(tmp_path, saved_cap):
    """A saved profile's max_batch_size (0: only memory; 64: a larger engine's, mutation review
    s58) replaced engine.max_batch_size in the plans."""
    import json

    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"batch_sizes": [1, 64], "ptl_s": [0.001, 0.002], "kv_tokens": 2048,
                                "block_size": 16, "max_batch_size": saved_cap}))
    cfg = from_dict({"engine": {"max_batch_size": 4, "kv_cache_tokens": 4096, "device": "cpu"},
                     "dispatch": {"profile": str(prof)}, "placement": {"generation": [1], "trainer": [2]}},
                    world_size=3)
    p = _profile(cfg)
    assert p.max_batch_size == 4 and p.batch_sizes == [1, 64]


def test_a_dispatch_profile_of_another_engine_gets_this_runs_kv(tmp_path, capsys):
    """A profile measured on an engine with 256 KV tokens capped this run's 16,384-token,
    64-sequence engine at 5 sequences (skew_paper, skew's no-preemption cap), silently (flows
    review, s59): its step times stay, the KV is the run's engine's, and that is said."""
    from controller.scheduling import PTLProfile

    prof = tmp_path / "small.json"
    PTLProfile([1, 8], [0.001, 0.004], 256, block_size=16, kv_s_per_token=1e-6, ref_context=64).save(prof)
    cfg = from_dict({"engine": {"max_batch_size": 64, "kv_cache_tokens": 16384, "block_size": 16, "device": "cpu"},
                     "dispatch": {"profile": str(prof)}, "placement": {"generation": [1], "trainer": [2]}},
                    world_size=3)
    p = _profile(cfg)
    assert (p.kv_tokens, p.block_size, p.max_batch_size) == (cfg.engine.total_blocks * 16, 16, 64)
    assert (p.batch_sizes, p.ptl_s, p.kv_s_per_token, p.ref_context) == ([1, 8], [0.001, 0.004], 1e-6, 64)
    assert (f"[sgs] dispatch.profile {prof}: measured on an engine with 256 KV tokens in blocks of 16; this run's "
            f"hold {p.kv_tokens} in blocks of 16") in capsys.readouterr().err
