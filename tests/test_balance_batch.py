"""``pipeline.balance_batch`` (verl's ``trainer.balance_batch``): the groups of an iteration go
to the trainer DP ranks by their expected tokens, longest first to the least loaded rank, not by
their index; ``train/rank_tokens_max`` / ``_min`` (verl's ``global_seqlen/max``, ``min``) say
how even the ranks' work was."""
import json
import math

import torch

from runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401

from controller.outbox import Outbox, balance, owner, route
from workers.types import SAMPLE_STRIDE, Request, Sample


def _group(gid: int, prompt_len: int, n: int, est: float, max_tokens: int = 100, min_tokens: int = 0):
    return [Request(gid * n + k, torch.ones(prompt_len, dtype=torch.long), max_tokens, min_tokens, est,
                    group_id=gid) for k in range(n)]


def _loads(requests, n, rank_of, bounds=(0, math.inf)):
    loads = [0.0] * n
    for r in requests:
        est = r.est_len if r.est_len == r.est_len else 0.0  # NaN: the floor
        loads[rank_of(r)] += len(r.prompt_ids) + min(max(est, bounds[0], 1), bounds[1])
    return loads


def test_long_groups_spread_and_each_group_stays_on_one_rank():
    # one long group first, then short ones: by index (route) rank 0 takes the long one and as
    # many short ones as rank 1
    it = 3
    sizes = [(40, 100.0)] + [(4, 10.0)] * 7
    reqs = [r for g, (p, est) in enumerate(sizes) for r in _group(it * SAMPLE_STRIDE + g, p, 2, est)]
    by_index = _loads(reqs, 2, lambda r: route(r.group_id, 2))
    balance(reqs, 2, it)
    for g in {r.group_id for r in reqs}:
        assert len({r.trainer_rank for r in reqs if r.group_id == g}) == 1
    loads = _loads(reqs, 2, lambda r: owner(r, 2))
    assert max(loads) == 280.0 and min(loads) == 7 * 28.0  # the long group alone; the short ones together
    assert max(by_index) == 280.0 + 3 * 28.0


def test_the_estimate_counts_within_the_runs_bounds_not_the_requests_forced_length():
    # the run's (train.min_tokens, train.max_tokens) = (2, 80) bound the ranker's estimates; a
    # request's own min/max_tokens are its forced, true length under train.length_trace, and
    # balancing by them placed groups by the lengths they would get (review, s60); NaN: the floor
    reqs = (_group(0, 1, 1, est=500.0, max_tokens=20, min_tokens=20) + _group(1, 1, 1, est=math.nan, min_tokens=30)
            + _group(2, 1, 1, est=25.0, max_tokens=50, min_tokens=50) + _group(3, 1, 1, est=0.0))
    balance(reqs, 2, 0, bounds=(2, 80))
    # 81 alone, then 26, 3 and 3 beside each other
    assert len({reqs[1].trainer_rank, reqs[2].trainer_rank, reqs[3].trainer_rank}) == 1
    assert reqs[0].trainer_rank != reqs[2].trainer_rank
    loads = _loads(reqs, 2, lambda r: owner(r, 2), bounds=(2, 80))
    assert (loads[reqs[0].trainer_rank], loads[reqs[2].trainer_rank]) == (81.0, 32.0)


def test_ties_rotate_with_the_iteration():
    """Equal groups, 3 on 2 ranks: the odd one goes to each rank in turn, as route rotates it."""
    extra = []
    for it in range(4):
        reqs = [r for g in range(3) for r in _group(it * SAMPLE_STRIDE + g, 5, 2, 8.0)]
        balance(reqs, 2, it)
        ranks = [r.trainer_rank for r in reqs]
        extra.append(max(set(ranks), key=ranks.count))
    assert extra == [0, 1, 0, 1]


class _FakeTrainer:
    """A trainer RRef's ``rpc_async().receive(samples)``, recorded (no process here)."""

    def __init__(self):
        self.calls = []

    def rpc_async(self):
        return self

    def receive(self, samples):
        self.calls.append(sorted(s.sample_id for s in samples))
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def test_the_outbox_sends_a_group_to_its_owner_and_the_rest_by_route():
    trainers = [_FakeTrainer(), _FakeTrainer()]
    out = Outbox(trainers, window_s=60.0, owners={0: 1})
    ids = torch.tensor([1, 2])
    for sid, g in ((0, 0), (1, 0), (2, 1), (3, 2)):  # group 0 -> rank 1 (owner); 1 -> 1, 2 -> 0 (route)
        out.put(Sample(sid, ids, ids, torch.zeros(2), 0, "length", g))
    out.close()
    assert trainers[0].calls == [[3]] and trainers[1].calls == [[0, 1, 2]]


def test_a_two_rank_run_balances_the_tokens_its_ranks_take(tmp_path, tiny_model):  # noqa: F811
    """Four prompts, one far longer than the rest, on two trainer ranks: by index (two groups a
    rank, whatever the order) a short one went with it; balanced, it trains alone. The rows say
    so (rank_tokens_max, _min)."""
    data = tmp_path / "d.jsonl"
    prompts = ["Add these: " + " + ".join(str(i) for i in range(60)) + "?"]
    prompts += [f"What is {i} plus {i}?" for i in (1, 2, 3)]
    data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    rows = {}
    for balanced in (False, True):
        logdir = tmp_path / f"run{int(balanced)}"
        cfg = write_config(tmp_path, tiny_model, task__name="jsonl", task__kwargs={"files": str(data)},
                           placement__trainer=[2, 3], train__iterations=1, train__eval_every=0,
                           train__max_tokens=4, train__min_tokens=4, pipeline__mode="stream",
                           pipeline__balance_batch=balanced, logging__logdir=str(logdir))
        p = torchrun(cfg, nproc=4, timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        rows[balanced] = iterations(logdir)[0]["metrics"]
    by_index, even = rows[False], rows[True]
    assert by_index["num_samples"] == even["num_samples"] == 8
    total = by_index["rank_tokens_max"] + by_index["rank_tokens_min"]
    assert even["rank_tokens_max"] + even["rank_tokens_min"] == total  # the same samples, split otherwise
    assert even["rank_tokens_max"] < by_index["rank_tokens_max"]
    assert even["rank_tokens_max"] - even["rank_tokens_min"] < by_index["rank_tokens_max"] - by_index["rank_tokens_min"]


def test_refills_go_on_from_the_loads_the_iteration_placed():
    """DAPO's refills (trainer.filter_groups with train_groups) are balanced batch by batch: from
    zero loads each time, every refill put its groups on the same ranks ([0, 4, 4, 0] on 4 ranks
    where route gives [2, 2, 2, 2]; review, session 50)."""
    it, loads, reqs = 5, [0.0] * 4, []
    for batch in range(4):  # make_batch, then three refills of 2 equal groups each
        new = [r for g in range(2) for r in _group(it * SAMPLE_STRIDE + 2 * batch + g, 10, 2, 64.0)]
        balance(new, 4, it, loads)
        reqs += new
    per_rank = [len({r.group_id for r in reqs if r.trainer_rank == t}) for t in range(4)]
    assert per_rank == [2, 2, 2, 2] and loads == [2 * 2 * 74.0] * 4
