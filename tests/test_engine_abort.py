"""NativeEngine.abort (vLLM's ``abort_request``) and its use by GenerationInstance.

An aborted request is cancelled wherever it is (waiting, running, preempted, requeued after a
step that failed): its blocks are freed, its reference on a group's shared prompt prefix dropped,
no Sample of it comes out later, and its sample_id / group_id can be used again. The requests
left are served exactly as by an engine that never had the aborted ones (greedy, token for
token). The instance aborts what a scale-in (``stop``) or a failed call leaves in its engine."""
import pytest
import torch

from controller.rpc import WorkerHandle
from controller.scheduling import make_dispatcher
from controller.sgs import SGS
from runtime_helpers import LocalRRef, SinkTrainer, tiny_model  # noqa: F401  (tiny_model: session-wide model folder)
from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.generation.sequence import Status
from workers.model import CausalLM, ModelConfig, init_weights
from workers.types import Request, SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)
V = 97
MODEL = init_weights(CausalLM(ModelConfig(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256)), seed=0, std=0.2).eval()


def engine(**kw) -> NativeEngine:
    base = dict(block_size=4, kv_cache_tokens=4096, max_batch_size=8)
    base.update(kw)
    return NativeEngine(EngineConfig(**base), model=MODEL)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def req(sid: int, p: torch.Tensor, new: int = 10, group: int = -1) -> Request:
    return Request(sample_id=sid, prompt_ids=p, max_tokens=new, min_tokens=new, sampling=GREEDY,
                   group_id=group)


def mixed(n: int, new: int = 10) -> list[Request]:
    return [req(i, prompt(3 + 4 * i, seed=i), new) for i in range(n)]


def run(eng: NativeEngine, max_steps: int = 500) -> dict[int, list[int]]:
    """Step until idle (bounded: a stuck engine fails the test instead of hanging it)."""
    out = {}
    for _ in range(max_steps):
        if not eng.has_work():
            return out
        for s in eng.step():
            assert s.sample_id not in out
            out[s.sample_id] = s.output_ids.tolist()
    raise AssertionError(f"engine still has work after {max_steps} steps: {eng.stats()}")


def reference(requests: list[Request], **kw) -> dict[int, list[int]]:
    """Greedy outputs of an engine that only ever had ``requests``."""
    return {s.sample_id: s.output_ids.tolist() for s in generate_all(engine(**kw), requests)}


def assert_empty(eng: NativeEngine) -> None:
    st = eng.stats()
    assert (st.kv_blocks_used, st.running, st.waiting) == (0, 0, 0) and not eng.has_work()
    assert st.kv_blocks_free == eng.bm.num_blocks and not any(eng.bm.ref)
    assert not eng.prefix.groups and not eng._live and not eng._group_live and not eng._group_prompt


def test_abort_waiting_requests():
    rs = mixed(5)
    eng = engine(max_batch_size=2)
    eng.add(rs)
    eng.step()  # prefill of 0 and 1; 2, 3, 4 wait
    assert [s.request.sample_id for s in eng.scheduler.waiting] == [2, 3, 4]
    assert eng.abort([3, 4]) == [3, 4]
    assert eng.stats().waiting == 1
    got = run(eng)
    assert got == reference(rs[:3], max_batch_size=2)  # 3 and 4 never come out
    assert_empty(eng)


def test_abort_running_requests_frees_their_blocks():
    rs = mixed(4)
    eng = engine()
    eng.add(rs)
    for _ in range(4):  # prefill + 3 decode steps
        eng.step()
    before = eng.stats().kv_blocks_used
    held = sum(len(eng._live[i].block_table) for i in (1, 2))
    assert eng.abort(iter([1, 2])) == [1, 2]  # any iterable
    st = eng.stats()
    assert st.running == 2 and st.kv_blocks_used == before - held > 0
    assert st.kv_blocks_free == eng.bm.num_blocks - st.kv_blocks_used
    assert run(eng) == reference([rs[0], rs[3]])
    assert_empty(eng)


def test_abort_a_preempted_request():
    rs = mixed(8, new=14)
    eng = engine(kv_cache_tokens=64)  # 16 blocks of 4: cannot hold all 8
    eng.add(rs)
    preempted = []
    while not preempted:
        eng.step()
        preempted = [s.request.sample_id for s in eng.scheduler.waiting if s.preempted]
    victim = preempted[0]
    assert eng._live[victim].num_output > 0 and not eng._live[victim].block_table
    assert eng.abort([victim]) == [victim]
    got = run(eng)
    assert victim not in got
    assert got == reference([r for r in rs if r.sample_id != victim], kv_cache_tokens=64)
    assert_empty(eng)


def test_abort_samples_of_a_prefix_shared_group():
    p = prompt(13, seed=7)  # block size 4: tokens [0, 12) in 3 pinned blocks, the 4th copied on write
    rs = [req(i, p, group=5) for i in range(4)]
    eng = engine()
    eng.add(rs)
    for _ in range(3):  # the first sample computes the prompt, then its siblings attach
        eng.step()
    pin = eng.prefix.groups[5].blocks
    assert len(pin) == 3 and [eng.bm.ref[b] for b in pin] == [5] * 3  # the pin + 4 samples
    private = eng._live[2].block_table[3:]
    assert eng.abort([2]) == [2]
    assert [eng.bm.ref[b] for b in pin] == [4] * 3
    assert all(eng.bm.ref[b] == 0 for b in private)
    assert eng.abort([0]) == [0]  # the sample that computed the prompt: the pin stays for the others
    assert [eng.bm.ref[b] for b in pin] == [3] * 3 and eng._group_live[5] == 2
    assert eng.add([req(9, p, group=5)]) == []  # a new sample of the live group shares the prefix
    eng.step()
    assert [eng.bm.ref[b] for b in pin] == [4] * 3
    got = run(eng)
    assert sorted(got) == [1, 3, 9]
    assert got == reference([rs[1], rs[3], req(9, p, group=5)])
    assert_empty(eng)


def test_aborting_a_waiting_sibling_keeps_the_prompt_being_computed():
    """While the group's first sample prefills the prompt in chunks, aborting a waiting sibling
    used to drop the pin: every other sample then computed the whole prompt itself."""
    p = prompt(40, seed=3)
    rs = [req(i, p, new=4, group=7) for i in range(3)]
    eng = engine(max_prefill_tokens=8)
    eng.add(rs)
    eng.step()  # the owner's first chunk
    g = eng.prefix.groups[7]
    assert not g.ready and g.owner.request.sample_id == 0
    assert eng.abort([1]) == [1]
    assert eng.prefix.groups.get(7) is g  # still pinned, still computed by sample 0
    prefill = []
    orig = eng.runner.run
    eng.runner.run = lambda b: (prefill.append(sum(e - s.num_cached for s, e in zip(b.seqs, b.ends))
                                               if b.is_prefill else 0), orig(b))[1]
    got = run(eng)
    assert sum(prefill) < 2 * len(p)  # the prompt once (plus the copied tail), not once per sample
    assert sorted(got) == [0, 2] and got == reference([rs[0], rs[2]])
    assert_empty(eng)


def test_abort_a_whole_group_releases_its_pin_and_its_group_id():
    p = prompt(13, seed=7)
    eng = engine()
    eng.add([req(i, p, group=5) for i in range(3)])
    eng.step()
    eng.step()
    assert eng.abort([0, 1, 2]) == [0, 1, 2]
    assert_empty(eng)
    q = prompt(6, seed=8)  # another prompt under the same group id: accepted now
    assert eng.add([req(0, q, group=5), req(1, q, group=5)]) == []
    assert run(eng) == reference([req(0, q, group=5), req(1, q, group=5)])


def test_abort_everything_then_reuse_the_ids():
    rs = [req(10 + i, prompt(9, seed=3), group=2) for i in range(3)] + mixed(6)
    eng = engine(kv_cache_tokens=64, max_batch_size=6)  # 16 blocks: preemptions
    eng.add(rs)
    sch = eng.scheduler

    def everywhere() -> bool:  # running (one on the shared prefix), preempted, never admitted
        return (sum(s.group_id == 2 for s in sch.running) >= 2 and any(s.preempted for s in sch.waiting)
                and any(not s.preempted for s in sch.waiting))

    for _ in range(20):
        eng.step()
        if everywhere():
            break
    assert everywhere()
    live = set(eng._live)
    assert eng.abort([r.sample_id for r in rs]) == [r.sample_id for r in rs if r.sample_id in live]
    assert_empty(eng)
    assert eng.step() == []
    # the same sample ids and group id with other prompts (one per group)
    again = [req(10 + i, prompt(4, seed=50), 6, group=2) for i in range(3)] + \
        [req(i, prompt(5, seed=40 + i), 6) for i in range(6)]
    assert eng.add(again) == []
    assert run(eng) == reference(again)
    assert_empty(eng)


def test_unknown_finished_and_repeated_ids_are_ignored():
    rs = [req(i, prompt(3 + i, seed=i), new=3 + 3 * i) for i in range(4)]
    eng = engine(max_batch_size=2)
    eng.add(rs)
    done = []
    while not done:
        done = eng.step()
    finished = [s.sample_id for s in done]
    used = eng.stats().kv_blocks_used
    assert eng.abort([*finished, 999, -1]) == []
    assert eng.stats().kv_blocks_used == used
    left = [r.sample_id for r in rs if r.sample_id not in finished]
    assert finished == [0] and left == [1, 2, 3]
    assert eng.abort([left[0], left[0], 999]) == [left[0]]
    assert eng.abort([left[0]]) == []  # aborted already
    assert run(eng) == reference([r for r in rs if r.sample_id in left[1:]], max_batch_size=2)
    assert eng.abort([]) == []


def test_abort_after_a_failed_prefill_step():
    # the step computing a group's prompt fails (an engine error: the instance then aborts the
    # call's requests). The engine put that step's batch back in the queue and dropped the
    # group's unready pin (tests/test_engine_step_failure.py); aborting the sample that was
    # computing the prompt must not leave the group's other samples waiting for it.
    p = prompt(13, seed=7)
    rs = [req(i, p, group=3) for i in range(3)] + [req(7, prompt(5, seed=1))]
    eng = engine()
    eng.add(rs)
    run_step = eng.runner.run

    def fail(batch):
        raise RuntimeError("injected")

    eng.runner.run = fail
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.runner.run = run_step
    assert not eng.scheduler.running and 3 not in eng.prefix.groups
    assert [s.request.sample_id for s in eng.scheduler.waiting] == [0, 7, 1, 2]  # requeued ones first
    assert eng.abort([0, 7]) == [0, 7]
    assert eng.stats().kv_blocks_used == 0
    assert eng._live[1].status is Status.WAITING
    assert run(eng) == reference(rs[1:3])
    assert_empty(eng)


# ---- GenerationInstance: what a scale-in or a failed call leaves in the engine ------------------
def _instance(rank: int, model_dir: str, sink: SinkTrainer, **kw):
    from controller.instance import GenerationInstance

    cfg = EngineConfig(device="cpu", kv_cache_tokens=1024, block_size=4, **kw)
    inst = GenerationInstance(rank, cfg, model_dir, [0])
    inst.trainers = [LocalRRef(sink)]
    return inst


def _train_requests(n: int) -> list[Request]:
    """GRPO-like: pairs of samples share a prompt (and its cached prefix); 8 tokens, forced."""
    return [Request(i, torch.arange(5 + i // 2) + 3, 8, 8, group_id=i // 2, sampling=GREEDY) for i in range(n)]


def _stop_after(inst, steps: int) -> None:
    """Scale-in arrives while ``inst`` generates: ``stop()`` after ``steps`` engine steps."""
    step, count = inst.engine.step, [0]

    def stepping():
        count[0] += 1
        if count[0] == steps:
            inst.stop()
        return step()

    inst.engine.step = stepping


def test_scale_in_aborts_what_the_instance_leaves_and_the_sgs_serves_it_elsewhere(tiny_model):  # noqa: F811
    sink = SinkTrainer()
    leaving, staying = _instance(1, tiny_model, sink), _instance(2, tiny_model, sink)
    _stop_after(leaving, 3)
    sgs = SGS(make_dispatcher("round_robin"), lambda it: {s.sample_id for s in sink.samples})
    sgs.add(WorkerHandle(1, "generation", LocalRRef(leaving)))
    sgs.add(WorkerHandle(2, "generation", LocalRRef(staying)))
    rs = _train_requests(12)
    reports = sgs.generate(0, rs, 0).wait()
    left = next(r for r in reports if r.rank == 1)
    assert left.stopped and left.unfinished and sgs.removed == [(1, "stopped")]
    assert sorted(s.sample_id for s in sink.samples) == list(range(12))  # each sample once
    # the leaving instance's engine holds nothing: no request queued or running, no block used
    assert not leaving.engine.has_work()
    assert leaving.stats().engine.kv_blocks_used == 0 and leaving.stats().engine.running == 0
    assert all(len(s.output_ids) == 8 for s in sink.samples)


def test_a_stopped_generate_aborts_its_unfinished_requests(tiny_model):  # noqa: F811
    sink = SinkTrainer()
    inst = _instance(1, tiny_model, sink, max_batch_size=4)
    _stop_after(inst, 2)
    rep = inst.generate(0, _train_requests(8), 0)
    assert rep.stopped and sorted(rep.sample_ids + rep.unfinished) == list(range(8))
    assert rep.unfinished and not inst.engine.has_work() and inst.engine.stats().kv_blocks_used == 0
    assert sorted(s.sample_id for s in sink.samples) == sorted(rep.sample_ids)


def test_a_refused_generate_leaves_nothing_in_the_engine(tiny_model):  # noqa: F811
    inst = _instance(1, tiny_model, SinkTrainer(), max_model_len=64)
    rs = _train_requests(3) + [Request(9, torch.ones(80, dtype=torch.int64), 4, group_id=9)]
    with pytest.raises(ValueError, match="refused request 9"):
        inst.generate(0, rs, 0)
    assert not inst.engine.has_work() and inst.engine.stats().kv_blocks_used == 0


def test_a_refused_eval_is_aborted_not_run(tiny_model):  # noqa: F811
    inst = _instance(1, tiny_model, SinkTrainer(), max_model_len=64)
    ok = [Request(i, torch.tensor([1, 2, 3]), 4, sampling=GREEDY) for i in (0, 1)]
    long = Request(2, torch.ones(80, dtype=torch.int64), 4, sampling=GREEDY)
    with pytest.raises(ValueError, match="refused eval request 2"):
        inst.evaluate([*ok, long])
    assert inst.engine.total_tokens == 0  # nothing was generated for a call that fails anyway
    assert not inst.engine.has_work() and inst.engine.stats().kv_blocks_used == 0
    assert sorted(sid for sid, _ in inst.evaluate(ok).outputs) == [0, 1]  # the same ids are accepted again


def test_an_eval_between_rounds_runs_on_the_staged_weights(tiny_model):  # noqa: F811
    """An evaluation right after a push (sync modes; the REPL; after --resume) runs on the
    weights just staged, and says so; one during a round (async modes, ``newest=False``) runs
    on the weights held and names them (concurrency audit, session 19: evaluations ran one
    version behind what they were logged under)."""
    inst = _instance(1, tiny_model, SinkTrainer())
    reqs = lambda: [Request(-1, torch.tensor([1, 2, 3]), 6, 6, sampling=GREEDY)]  # noqa: E731
    before = inst.evaluate(reqs())
    assert before.weight_version == 0
    g = torch.Generator().manual_seed(7)
    new = {k: torch.randn(v.shape, generator=g) for k, v in inst.engine.model.named_parameters()}
    inst.stage_weights(new, 1)
    held = inst.evaluate(reqs())
    assert (held.weight_version, held.outputs) == (0, before.outputs)
    fresh = _instance(2, tiny_model, SinkTrainer())
    fresh.stage_weights({k: v.clone() for k, v in new.items()}, 1)
    fresh._swap_weights(1)
    after = inst.evaluate(reqs(), newest=True)
    assert after.weight_version == 1 and inst.stats().staged_version is None
    assert after.outputs == fresh.evaluate(reqs()).outputs != before.outputs
    inst.generate(3, [], 1)  # the next round, dispatched with v1, finds it loaded


def test_an_eval_failing_mid_way_leaves_nothing_queued(tiny_model):  # noqa: F811
    inst = _instance(1, tiny_model, SinkTrainer(), max_batch_size=2)
    ok = [Request(i, torch.tensor([1, 2, 3 + i]), 6, 6, sampling=GREEDY) for i in range(5)]
    want = inst.evaluate(ok)
    step, start = inst.engine.step, inst.engine.total_tokens

    def failing():
        if inst.engine.total_tokens > start:  # after the first (prefill) step
            raise RuntimeError("injected engine failure")
        return step()

    inst.engine.step = failing
    with pytest.raises(RuntimeError, match="injected"):
        inst.evaluate(ok)
    inst.engine.step = step
    assert not inst.engine.has_work() and inst.engine.stats().kv_blocks_used == 0
    assert inst.evaluate(ok) == want


def test_a_sample_that_failed_is_the_trainers_to_skip_and_evals_to_leave_out(tiny_model):  # noqa: F811
    """An error sample (a multi-turn environment that raised, a request vLLM refused when
    admitting it) came back as an empty output, scored as a wrong answer (until session 48), then
    failed the round or the evaluation, and the run with it (until session 53). A round hands it
    to the trainer like any sample (``trainer.on_bad_sample``: skip, counted, or error); an
    evaluation names it apart from its outputs (``EvalOutput.errors``: left out as unscored)."""
    from dataclasses import replace

    sink = SinkTrainer()
    inst = _instance(1, tiny_model, sink, max_batch_size=2)
    ok = [Request(i, torch.tensor([1, 2, 3 + i]), 6, 6, sampling=GREEDY) for i in range(4)]
    step = inst.engine.step

    def one_fails():
        return [replace(s, finish_reason="error", error="multi_turn.env: boom") if s.sample_id == 2 else s
                for s in step()]

    inst.engine.step = one_fails
    out = inst.evaluate(ok)
    assert sorted(sid for sid, _ in out.outputs) == [0, 1, 3]
    assert out.errors == [(2, "gen1: eval sample 2 failed: multi_turn.env: boom")]
    inst.generate(0, ok, 0)
    got = {s.sample_id: s for s in sink.samples}
    assert sorted(got) == [0, 1, 2, 3] and got[2].finish_reason == "error" and got[2].instance == 1
    inst.engine.step = step
    assert not inst.engine.has_work() and inst.engine.stats().kv_blocks_used == 0
