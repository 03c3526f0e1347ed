"""Controller runtime behaviour the rest of the suite let through when changed by one line
(mutation review, session 56): each sample's own sampling seed, the refill bound, nested spans in
the busy-time merge, the outbox's wait for its last send, failed samples' lengths, the keepalive
period under a short RPC timeout, the minibatch release size, the six modes' table."""
import threading
from dataclasses import replace

import pytest
import torch

from runtime_helpers import TASK, tiny_model  # noqa: F401  (the session-wide tiny model)
from test_obs_program import Clock, _program


def test_each_sample_of_a_group_draws_with_its_own_seed(monkeypatch):
    """The native engine seeds a sequence's generator from ``sampling.seed``: two requests of one
    prompt with one seed generate the same answer (a GRPO group of identical samples: advantages 0)."""
    p = _program(monkeypatch, "batch", Clock())
    reqs = p.make_batch(0).requests + p.make_batch(1).requests
    seeds = [r.sampling.seed for r in reqs]
    assert len(set(seeds)) == len(seeds)  # within a group, across groups and across iterations


def test_a_refill_generates_at_most_max_gen_batches_batches(monkeypatch):
    """``HalfKeptTrainer`` (tests/test_refill_program.py) keeps half the groups: train_groups 100 is
    never reached, so the iteration generates exactly max_gen_batches batches, then trains."""
    from test_refill_program import BATCH, _refill_program

    p, trainer = _refill_program(monkeypatch, "stream")
    p.cfg.trainer.train_groups, p.cfg.trainer.max_gen_batches = 100, 3
    res = p.run(1)[0]
    assert res.metrics["gen_batches"] == 3.0
    assert len(trainer.groups[0]) == 3 * BATCH


def test_merge_intervals_keeps_a_nested_spans_outer_end():
    from controller.timeline import Span, bubble_fractions, merge_intervals

    outer, inner = Span("train1", "train", 0.0, 10.0, 0), Span("train1", "train", 2.0, 5.0, 0)
    assert merge_intervals([outer, inner]) == [(0.0, 10.0)]
    assert bubble_fractions([outer, inner], (0.0, 10.0)) == {"train1": 0.0}


def test_outbox_close_waits_for_the_last_send_and_raises_its_failure():
    """A stand-in trainer (a unit test of the Outbox: real RPC futures cannot be failed on demand):
    its answer comes later, and fails."""
    from controller.outbox import Outbox
    from test_sample_stream import _FakeTrainer, _sample

    class LateFailure(_FakeTrainer):
        def receive(self, samples):
            fut = torch.futures.Future()
            threading.Timer(0.2, fut.set_exception, (RuntimeError("trainer refused the samples"),)).start()
            return fut

    out = Outbox([LateFailure()], window_s=0.0)
    out.put(_sample(1, 0))
    with pytest.raises(RuntimeError, match="trainer refused"):
        out.close()


def test_a_failed_samples_length_is_not_reported(tiny_model):  # noqa: F811
    from controller.trainer_rank import TrainerRank
    from workers.tasks.registry import make_task
    from workers.tokenizer import Tokenizer
    from workers.trainer.config import TrainerConfig
    from workers.types import Sample

    tok = Tokenizer.load(tiny_model)
    items = make_task("synthetic", **TASK).prompts("train")[:2]
    ids = torch.tensor(tok.encode(tok.format_prompt(items[0].prompt)))
    ok = [Sample(g * 2 + k, ids, torch.tensor(tok.encode(items[g].answer) + [tok.eos_id]), torch.full((0,), -2.0),
                 0, "stop", g) for g in range(2) for k in range(2)]
    ok = [replace(s, logprobs=torch.full((len(s.output_ids),), -2.0)) for s in ok]
    failed = replace(ok[3], output_ids=torch.zeros(0, dtype=torch.long), logprobs=torch.zeros(0),
                     finish_reason="error", error="kv cache exhausted")
    rank = TrainerRank(1, [1], TrainerConfig(algorithm="grpo", seed=0), tiny_model, "synthetic", TASK)
    rank.begin_iteration(0, {s.sample_id: items[s.group_id] for s in ok}, {0: 2, 1: 2}, "stream", 4)
    rank.receive(ok[:3] + [failed])
    rep = rank.step(0)
    rank.close()
    assert rep.lengths == {s.sample_id: len(s.output_ids) for s in ok[:3]}  # not {3: 0}


def test_the_ping_period_is_a_quarter_of_a_short_rpc_timeout():
    from controller import keepalive

    assert keepalive.period(8.0) == 2.0  # pinged every 10 s, a worker would leave after 8 s of silence
    assert keepalive.period(600.0) == keepalive.KEEPALIVE_S


def test_the_minibatch_release_hands_over_fixed_size_minibatches():
    from controller.trainer_inbox import IterationInbox
    from test_sample_stream import _sample

    rec = IterationInbox(0, {i: None for i in range(7)}, {}, "minibatch", 3, 0)
    rec.pending += [_sample(i, 0) for i in range(2)]
    assert rec.release() == []  # 2 < 3: wait
    rec.pending.append(_sample(2, 0))
    assert [s.sample_id for s in rec.release()] == [0, 1, 2]  # exactly one minibatch, at once
    rec.consumed = 3
    rec.pending += [_sample(i, 0) for i in range(3, 7)]
    assert [s.sample_id for s in rec.release()] == [3, 4, 5]  # one minibatch, not all four
    rec.consumed = 6
    assert [s.sample_id for s in rec.release()] == [6]  # the iteration's rest


def test_the_six_modes_release_lag_and_colocation():
    from controller.modes import MODES

    assert {n: (m.release, m.lag, m.colocated) for n, m in MODES.items()} == {
        "colocated": ("all", 0, True), "batch": ("all", 0, False), "minibatch": ("minibatch", 0, False),
        "stream": ("stream", 0, False), "async_batch": ("all", 1, False), "async_stream": ("stream", 1, False)}
