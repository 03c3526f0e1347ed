"""Multi-turn engine behaviour the rest of the suite let through when changed by one line
(mutation review, session 56): a turn ending on EOS exactly at the budget is a stop, a seeded
continuation draws the next turn's seed, the engine's context ends a trajectory cleanly."""
from test_multi_turn_engine import GREEDY, PROMPT, Script, first_stop, req, run, wrap
from workers.generation.generate_all import generate_all
from workers.types import Request


def test_a_turn_ending_on_eos_exactly_at_the_budget_is_stop_and_calls_no_environment():
    """A first turn that ends in EOS with no output budget left: the trajectory is done
    ("stop", one turn), the environment is not asked for an observation that cannot fit."""
    eos, turn1 = first_stop()
    env = Script("obs one result: 7", None)
    [s] = run(wrap(eos, env), [req(max_tokens=len(turn1))])
    assert s.output_ids.tolist() == turn1 and s.turns == 1
    assert s.finish_reason == "stop"
    assert env.calls == []


def test_a_seeded_continuation_draws_the_next_turns_seed_not_the_first_turns():
    """Each continuation request handed to the (real) inner engine carries the turn-mixed seed
    (turn_sampling), so turn 2 does not replay turn 1's random draws. The inner engine's add is
    only wrapped to record what it is given."""
    from test_multi_turn_engine import HALF, OBS, PROMPT
    from workers.generation.trajectory import turn_sampling
    from workers.types import Request, SamplingParams

    eng = wrap(HALF, Script(OBS, None))
    seen, add = [], eng.inner.add
    eng.inner.add = lambda rs: (seen.extend(rs), add(rs))[1]
    sp = SamplingParams(temperature=1.0, seed=5)
    [s] = run(eng, [Request(1, PROMPT, 40, sampling=sp, group_id=7)])
    assert s.turns == 2 and len(seen) == 2
    assert seen[0].sampling.seed == 5
    assert seen[1].sampling.seed == turn_sampling(sp, 1).seed != 5


def test_the_engines_context_ends_a_trajectory_cleanly():
    """The inner engine's max_model_len (prompt + every turn and observation) bounds the
    trajectory like max_tokens: a first turn that fills the context ends it ("stop"), no
    environment call, no continuation the engine would refuse as too long."""
    from test_multi_turn_engine import MODEL, PROMPT
    from workers.generation.config import EngineConfig
    from workers.generation.engine import NativeEngine
    from workers.generation.multi_turn import MultiTurnEngine
    from test_multi_turn_engine import TOK

    eos, turn1 = first_stop()
    env = Script("obs one", None)
    inner = NativeEngine(EngineConfig(block_size=4, kv_cache_tokens=4096, max_batch_size=8, eos_ids=tuple(eos),
                                      max_model_len=len(PROMPT) + len(turn1)), model=MODEL)
    [s] = run(MultiTurnEngine(inner, TOK, env, "script"), [req(max_tokens=40)])
    assert s.finish_reason == "stop" and s.output_ids.tolist() == turn1
    assert env.calls == []


def test_the_multi_turn_engine_refuses_a_bad_sample_id_and_aborting_it_changes_nothing():
    """MultiTurnEngine keys its trajectories by sample id: a list id was a TypeError for the whole
    batch, a bool/str id was served (real MultiTurnEngine over the native engine)."""
    eng = wrap((0,), Script(None))
    reqs = [Request(0, PROMPT, 2, sampling=GREEDY, group_id=-1), Request([1], PROMPT, 2, group_id=-1),
            Request(True, PROMPT, 2, sampling=GREEDY, group_id=-1), Request("a", PROMPT, 2, group_id=-1)]
    assert eng.abort([[1], 0]) == []
    out = {repr(s.sample_id): s for s in generate_all(eng, reqs)}
    assert out["[1]"].finish_reason == "error" and "sample_id must be an int, got list [1]" in out["[1]"].error
    assert out["True"].finish_reason == "error" and "got bool True" in out["True"].error
    assert out["'a'"].finish_reason == "error" and "got str 'a'" in out["'a'"].error
    assert out["0"].finish_reason != "error"
    eng.close()
