"""The RL loop's own timings and labels (controller/program.py), on the real Program and SGS
with stand-in instances and a trainer that advance a clock of the test's: generation time is
generation's own in the async modes, wait_push spans name the same iteration in every mode,
the batch's lengths, evaluations with their span and prompt count."""
from types import SimpleNamespace

import pytest

import controller.evaluation as evaluation_mod
import controller.program as program_mod
import controller.rpc as rpc_mod
import controller.timeline as timeline_mod
from controller.config import DispatchSection, LoggingSection, MultiTurnSection
from controller.data import PromptStream
from controller.instance import EvalOutput, GenerateReport
from controller.program import Program
from controller.rpc import WorkerHandle
from controller.scheduling import make_dispatcher
from controller.sgs import SGS
from controller.trainer_rank import StepReport
from runtime_helpers import LocalRRef
from workers.types import TaskPrompt

GEN_S, STEP_S, PUSH_S, EVAL_S = 1.0, 5.0, 0.25, 2.0
MAX_TOKENS = 6
TRAIN = [TaskPrompt(f"{10 ** i} + {i} =", str(10 ** i + i), "sum") for i in range(5)]  # 7..11 characters


class Clock:
    """The program's time.time(): advanced by the stand-ins' work, never by waiting."""

    def __init__(self):
        self.t = 1000.0

    def time(self) -> float:
        return self.t

    monotonic = time  # the heartbeat's clock (rpc.Call), on the same fake time


class Instance:
    def __init__(self, clock):
        self.clock = clock
        self.held, self.staged, self.newest = 0, None, []  # weight versions; evaluate's newest flags

    def generate(self, iteration, requests, version, cap, window):
        self.held = version
        self.clock.t += GEN_S
        lengths = [MAX_TOKENS if r.sample_id % 2 else 3 for r in requests]  # every other sample cut
        return GenerateReport(1, iteration, [r.sample_id for r in requests], sum(lengths), GEN_S, version, lengths)

    def receive_weights(self, version):
        self.clock.t += PUSH_S
        self.staged = version
        return version

    def evaluate(self, requests, newest=False, token=None, stage="eval", step=None):
        self.clock.t += EVAL_S
        self.newest.append(newest)
        if newest and self.staged is not None:
            self.held, self.staged = self.staged, None
        return EvalOutput(self.held, [(r.sample_id, [7]) for r in requests])


class Trainer:
    def __init__(self, clock):
        self.clock, self.version, self.duplicates = clock, 0, 0

    def begin_iteration(self, *args):
        return True

    def step(self, iteration):
        self.clock.t += STEP_S
        self.version += 1
        sids = [iteration * program_mod.SAMPLE_STRIDE + j for j in range(4)]  # what Instance generated
        return StepReport(2, iteration, self.version, {"reward_mean": 0.5, "num_samples": 4.0, "num_tokens": 18.0},
                          4, 18, 0, self.duplicates, lengths={s: MAX_TOKENS if s % 2 else 3 for s in sids},
                          per_instance={1: 4})


def _program(monkeypatch, mode: str, clock: Clock) -> Program:
    monkeypatch.setattr(program_mod, "time", clock)
    monkeypatch.setattr(rpc_mod, "time", clock)  # when each call ended (rpc.Completions)
    monkeypatch.setattr(evaluation_mod, "time", clock)
    monkeypatch.setattr(timeline_mod, "time", clock)  # the spans' clock
    inst = WorkerHandle(1, "generation", LocalRRef(Instance(clock)))
    sgs = SGS(make_dispatcher("round_robin"), lambda it: set())
    sgs.add(inst)
    world = SimpleNamespace(sgs=sgs, trainers=[WorkerHandle(2, "trainer", LocalRRef(Trainer(clock)))],
                            colocated=False, drain_spans=lambda: [],
                            push_weights=lambda v: [inst.call("receive_weights", v)])
    train = SimpleNamespace(seed=0, batch_prompts=2, group_size=2, max_tokens=MAX_TOKENS, min_tokens=0,
                            temperature=1.0, top_k=-1, top_p=1.0, eval_samples=1, eval_temperature=0.0,
                            overlong_prompts="error", max_prompt_tokens=0)
    pipeline = SimpleNamespace(mode=mode, minibatch_size=0, stream_window_s=0.02, balance_batch=False)
    cfg = SimpleNamespace(pipeline=pipeline, train=train,
                          ranker=SimpleNamespace(update_every=0), task=SimpleNamespace(name="synthetic", kwargs={}),
                          trainer=SimpleNamespace(max_staleness=1, reward_workers=1, reward_pool="threads",
                                                  reward_timeout_s=None, reward_batch_size=None),
                          multi_turn=MultiTurnSection(), logging=LoggingSection(), dispatch=DispatchSection())
    prompts = {"train": TRAIN,
               "test": [TaskPrompt(f"{i} + 1 =", str(i + 1), "sum") for i in range(3)]}
    task = SimpleNamespace(prompts=lambda split: prompts[split], score=lambda item, text: 1.0)
    tok = SimpleNamespace(encode_prompt=lambda text, messages=(): list(range(len(text))), decode=lambda ids: "x")
    return Program(cfg, world, tok, task)


@pytest.mark.parametrize("mode", ["async_stream", "async_batch", "batch", "stream"])
def test_generation_time_is_generations_own_in_every_mode(monkeypatch, mode):
    # async: G(i+1) is dispatched before step(i) and finishes during it, but the controller
    # waits for it only after the step: the old figure (its wait's end - the batch's draw)
    # was 1 + 5 = 6 s, the controller's schedule, not generation's
    res = _program(monkeypatch, mode, Clock()).run(4)
    assert [r.gen_seconds for r in res] == [GEN_S] * 4
    assert [r.train_seconds for r in res][1:] == [STEP_S] * 3
    assert all(r.iter_seconds >= GEN_S + STEP_S for r in res)


@pytest.mark.parametrize("mode", ["batch", "async_stream"])
def test_wait_push_spans_name_the_iteration_that_waits_for_the_weights(monkeypatch, mode):
    # the docs: wait_push carries the iteration that comes next (the one generating with those
    # weights); lag-0 modes labelled it with the iteration just trained
    p = _program(monkeypatch, mode, Clock())
    p.run(3)
    spans = p.spans.drain()
    order = [(s.stage, s.iteration) for s in sorted(spans, key=lambda s: s.start)
             if s.stage in ("dispatch", "wait_push")]
    for k, (stage, it) in enumerate(order):
        if stage == "wait_push":  # the next dispatch's, or after the run the next run's first (3)
            assert it == next((i for st, i in order[k:] if st == "dispatch"), 3), order
    assert order[-1] == ("wait_push", 3)


def test_batch_lengths(monkeypatch):
    res = _program(monkeypatch, "batch", Clock()).run(1)[0]
    first = PromptStream(TRAIN, 0).next(2)  # iteration 0's prompts (train.seed 0), each sampled twice
    lens = [len(p.prompt) for p in first]  # the stand-in tokenizer: a token per character
    assert len(set(lens)) == 2
    assert res.batch["response_len_max"] == MAX_TOKENS and res.batch["response_len_min"] == 3
    assert res.batch["response_clip_ratio"] == 0.5  # verl's response_length/clip_ratio
    assert res.batch["prompt_len_max"] == max(lens) and res.batch["prompt_len_mean"] == sum(lens) / 2
    assert res.batch["epoch"] == 0


def test_batch_epoch_is_that_of_the_batch_first_prompt():
    # a batch drawn right after an epoch's last prompt belongs to the next epoch (the stream
    # turns over as it is drawn, so its state before the batch still said the old one)
    from types import SimpleNamespace

    from controller.config import from_dict
    items = [TaskPrompt(f"p{i}", str(i), "t") for i in range(4)]
    p = Program(from_dict({"train": {"batch_prompts": 4, "group_size": 2}}),
                SimpleNamespace(sgs=SimpleNamespace(stream_window_s=0.0)),
                SimpleNamespace(encode_prompt=lambda text, messages=(): [1, 2]), SimpleNamespace(prompts=lambda split: items))
    assert [p._batch_stats(p.make_batch(i), [1])["epoch"] for i in range(3)] == [0, 1, 2]
    p = Program(from_dict({"train": {"batch_prompts": 3, "group_size": 2}}),
                SimpleNamespace(sgs=SimpleNamespace(stream_window_s=0.0)),
                SimpleNamespace(encode_prompt=lambda text, messages=(): [1, 2]), SimpleNamespace(prompts=lambda split: items))
    assert [p._batch_stats(p.make_batch(i), [1])["epoch"] for i in range(4)] == [0, 0, 1, 2]  # 0-2, 3+0, 1-3, 0-2


def test_evaluate_reports_its_prompts_and_time(monkeypatch):
    clock = Clock()
    p = _program(monkeypatch, "batch", clock)
    p.run(1)
    t0 = clock.t
    ev = evaluation_mod.evaluate(p, 2)
    assert (ev.prompts, ev.requested, ev.split, ev.samples, ev.started, ev.seconds) == (2, 2, 3, 1, t0, EVAL_S)
    assert ev.scores == {"eval/sum": 1.0, "eval/mean": 1.0, "eval/sum/reward/mean@1": 1.0}
    assert evaluation_mod.evaluate(p, 100).prompts == 3  # more than the split: all of it (the REPL says so)
    assert ev.weight_versions == (1,)  # no round in flight: on the weights just pushed, not those of the round


def test_an_evaluation_during_a_round_runs_on_the_weights_held(monkeypatch):
    """Async modes evaluate (train.eval_every) while the next round generates: the instances
    keep the round's weights, and the evaluation says which it ran with."""
    clock = Clock()
    p = _program(monkeypatch, "async_stream", clock)
    seen = []
    p.on_iteration = lambda res: seen.append((res.iteration, p.in_flight is not None,
                                              evaluation_mod.evaluate(p, 1).weight_versions))
    p.run(3)
    inst = p.world.sgs.slots[0].handle.rref.obj
    assert seen == [(0, True, (0,)), (1, True, (1,)), (2, False, (3,))]  # the last: drained, newest
    assert inst.newest == [False, False, True]


def test_duplicates_the_trainer_ranks_dropped_reach_the_metrics(monkeypatch):
    # TrainerRank drops a re-sent sample before its worker sees it: the logged
    # train/duplicates (the worker's count) was always 0 after a re-dispatch
    p = _program(monkeypatch, "batch", Clock())
    p.world.trainers[0].rref.obj.duplicates = 3
    assert p.run(1)[0].metrics["duplicates"] == 3.0


def test_a_verifier_that_raises_in_an_evaluation_is_said_once(monkeypatch, caplog):
    # it was one warning per prompt per evaluation (32 lines for an eval of 32 prompts)
    p = _program(monkeypatch, "batch", Clock())
    p.run(1)

    def score(prompt, completion):
        raise KeyError("no such field")

    monkeypatch.setattr(p.task, "score", score)
    with caplog.at_level("WARNING"):
        ev = evaluation_mod.evaluate(p, 3)
    said = [r.getMessage() for r in caplog.records if "left out of eval/mean" in r.getMessage()]
    assert said == ["eval: 3 samples of 3 prompts (first: prompt 0) left out of eval/mean: the task's score "
                    "raised KeyError('no such field')"]
    assert ev.scores == {"eval/unscored": 3.0}


def test_the_last_instance_lost_in_a_weight_push_stops_the_run_with_no_instances_left(monkeypatch):
    # the push dropped it quietly; the next round's dispatcher then failed over zero instances with
    # a bare ValueError, a traceback instead of the run's one-line stop (review, session 47)
    from controller.sgs import NoInstancesLeft

    p = _program(monkeypatch, "batch", Clock())
    inst = p.world.sgs.slots[0].handle.rref.obj

    def receive_weights(version):
        raise RuntimeError("Connection reset by peer")  # the transport's word: its process is gone

    inst.receive_weights = receive_weights
    with pytest.raises(NoInstancesLeft, match="step 1: every generation instance is gone"):
        p.run(2)


def test_the_scale_out_policy_is_told_the_instances_that_generated_the_batch(monkeypatch):
    # async: a joiner added before iteration i did not generate batch i - 1 (already in flight),
    # but the policy was told the instances of now (review, session 47)
    from controller.session import Session

    clock = Clock()
    p = _program(monkeypatch, "async_stream", clock)
    seen, results = [], {}

    class Policy:
        def observe(self, iteration, gen, train, lens, instances, spare=None):
            seen.append((iteration, instances))
            return SimpleNamespace(add=False, delta_prime_s=0.0)

    session = SimpleNamespace(
        program=SimpleNamespace(drain_spans=lambda: [], mode=p.mode),
        metrics=SimpleNamespace(log_iteration=lambda res, spans: {"time/generate_busy_s": 1.0, "time/train_busy_s": 1.0},
                                log_scalars=lambda *a: None),
        policy=Policy(), waiting=[], world=p.world, progress=None, want_add=False,
        cfg=SimpleNamespace(train=SimpleNamespace(iterations=10, eval_every=0, ckpt_every=0),
                            logging=SimpleNamespace(progress=False), pipeline=SimpleNamespace(mode="async_stream")))

    def on_iteration(res):
        results[res.iteration] = res
        Session._on_iteration(session, res)

    def before(i):
        if i == 2:  # a joiner at iteration 2's boundary, G(1) in flight
            p.world.sgs.add(WorkerHandle(3, "generation", LocalRRef(Instance(clock))))

    p.on_iteration, p.before_iteration = on_iteration, before
    p.run(3)
    assert seen and all(n == results[it].instances for it, n in seen), (seen, {i: r.instances for i, r in results.items()})
    assert [n for _, n in seen] == [1, 1, 2]


def test_best_at_k_is_left_out_when_nothing_was_scored(monkeypatch):
    """(As eval/mean: a 0.0 would read as no prompt ever solved.)"""
    p = _program(monkeypatch, "batch", Clock())
    p.cfg.train.eval_samples = 2
    p.run(1)

    def score(prompt, completion):
        raise KeyError("no such field")

    monkeypatch.setattr(p.task, "score", score)
    assert evaluation_mod.evaluate(p, 3).scores == {"eval/unscored": 6.0}
    monkeypatch.setattr(p.task, "score", lambda prompt, completion: 0.5)
    assert evaluation_mod.evaluate(p, 3).scores == {"eval/sum": 0.5, "eval/mean": 0.5, "eval/best@2": 0.5,
                                                    "eval/sum/reward/mean@2": 0.5, "eval/sum/reward/std@2": 0.0,
                                                    **{f"eval/sum/reward/{s}@2/{m}": 0.5 if m == "mean" else 0.0
                                                       for s in ("best", "worst") for m in ("mean", "std")}}


def test_a_whole_run_keeps_no_list_of_its_results(monkeypatch):
    """The session's one run() of the whole run kept every IterationResult (with its per-sample
    lengths) to the end, beside the bounded history (session 51's second review)."""
    p = _program(monkeypatch, "batch", Clock())
    assert p.run(3, keep=False) == [] and len(p.history) == 3
    assert len(p.run(2)) == 2  # the REPL's run K gets its results
