"""DAPO's dynamic sampling filter (``trainer.filter_groups`` / ``train_groups``; verl's
``algorithm.filter_groups``): which groups train, on one rank and over two, what the metrics
count, and the config. Samples are built by hand with known scores (``tests/test_trainer_stats``)."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.group_filter import filter_groups, uniform
from workers.weight_sync.localrun import run_local
from tests.test_trainer_stats import KnownRewardTask, build, model_dir  # noqa: F401

torch.set_num_threads(1)
# group id -> its samples' scores: 0 and 3 uniform (dropped), 4 a group of one (kept, as verl, unless
# the algorithm compares a sample with its group: then its advantage is 0 and it is dropped too)
GROUPS = [[(1.0, 3), (1.0, 4), (1.0, 2)], [(0.0, 3), (0.5, 3)], [(0.2, 2), (0.7, 5)], [(0.0, 2), (0.0, 3)],
          [(0.3, 4)], [(1.0, 2), (0.0, 3), (0.5, 2)]]


def _items(scores_of: dict[int, list[float]]):
    return [SimpleNamespace(group_id=g, score=s) for g, scores in scores_of.items() for s in scores]


def test_uniform_groups_are_dropped_and_the_first_train_groups_kept_in_prompt_order():
    items = _items({g: [s for s, _ in members] for g, members in enumerate(GROUPS)})
    assert [uniform([SimpleNamespace(score=s) for s, _ in m]) for m in GROUPS] == [True, False, False, True,
                                                                                    False, False]
    kept, counts = filter_groups(items, 0)
    assert sorted({p.group_id for p in kept}) == [1, 2, 4, 5] and len(kept) == 2 + 2 + 1 + 3
    assert counts == {"filtered_groups": 2.0, "surplus_groups": 0.0}
    kept, counts = filter_groups(list(reversed(items)), 2)  # prompt order, not arrival order
    assert sorted({p.group_id for p in kept}) == [1, 2] and counts == {"filtered_groups": 2.0, "surplus_groups": 2.0}
    # over ranks: this rank holds 1 and 5, another 2 and 4 (gathered): the first two overall are 1 and 2
    mine = [p for p in items if p.group_id in (1, 5)]
    kept, counts = filter_groups(mine, 2, gather=lambda ids: ids + [2, 4])
    assert {p.group_id for p in kept} == {1} and counts == {"filtered_groups": 0.0, "surplus_groups": 1.0}
    kept, counts = filter_groups(items, 0, drop_single=True)  # grpo / rloo: a group of one has advantage 0
    assert sorted({p.group_id for p in kept}) == [1, 2, 5] and counts["filtered_groups"] == 3.0


def _step(w, samples, prompts, sizes):
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    if w.cfg.filter_groups:
        assert not w._trained_any  # the filter needs the whole iteration: nothing trains at receive
    return w.step().metrics


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_trainer_trains_the_chosen_groups_only(model_dir, algorithm):  # noqa: F811
    samples, prompts, sizes = build(model_dir, GROUPS)
    w = TrainerWorker(TrainerConfig(algorithm=algorithm, filter_groups=True, train_groups=3), model_dir,
                      KnownRewardTask(), device="cpu")
    m = _step(w, samples, prompts, sizes)
    if algorithm == "ppo":
        chosen, counts = [1, 2, 4], (2.0, 1.0)  # 0 and 3 uniform, 5 past train_groups
    else:  # grpo: the group of one (4) has advantage 0 and is dropped too
        chosen, counts = [1, 2, 5], (3.0, 0.0)
    assert m["num_seqs"] == sum(len(GROUPS[g]) for g in chosen)
    assert m["num_tokens"] == sum(n for g in chosen for _, n in GROUPS[g])
    assert (m["filtered_groups"], m["surplus_groups"]) == counts
    assert m["num_samples"] == len(samples)  # the task's scores: of every sample received, as without it
    # the update equals training the chosen groups alone
    keep = {s.sample_id for s in samples if s.group_id in chosen}
    alone = TrainerWorker(TrainerConfig(algorithm=algorithm), model_dir, KnownRewardTask(), device="cpu")
    ref = _step(alone, [s for s in samples if s.sample_id in keep], prompts, {g: sizes[g] for g in chosen})
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for (k, a), (_, b) in zip(w.named_weights(), alone.named_weights()):
        assert torch.allclose(a, b, atol=1e-6), k


def _two_ranks(rank, world, model_dir, data):  # noqa: F811
    samples, prompts, sizes = data
    w = TrainerWorker(TrainerConfig(filter_groups=True, train_groups=3), model_dir, KnownRewardTask(), rank=rank,
                      world_size=world, device="cpu")
    mine = [s for s in samples if s.group_id % world == rank]
    w.begin_iteration(0, prompts, {g: n for g, n in sizes.items() if g % world == rank})
    w.receive(mine)
    return w.step().metrics, {k: v.clone() for k, v in w.named_weights()}


def test_two_ranks_choose_the_same_groups_as_one(model_dir):  # noqa: F811
    """Rank 0 holds groups 0, 2, 4 and rank 1 holds 1, 3, 5: the first three kept overall are 1, 2,
    5 (grpo drops the group of one, 4), one of them on rank 0; the update equals one rank's."""
    data = build(model_dir, GROUPS)
    (m0, w0), (m1, w1) = run_local(2, _two_ranks, model_dir, data)
    one = TrainerWorker(TrainerConfig(filter_groups=True, train_groups=3), model_dir, KnownRewardTask(), device="cpu")
    m = _step(one, *data)
    assert m0["num_seqs"] == m1["num_seqs"] == m["num_seqs"] == 7.0
    assert m0["filtered_groups"] == m["filtered_groups"] == 3.0 and m0["surplus_groups"] == 0.0
    for k in w0:
        assert torch.equal(w0[k], w1[k]) and torch.allclose(w0[k], dict(one.named_weights())[k], atol=1e-6), k


def test_config():
    cfg = from_dict({"trainer": {"filter_groups": True, "train_groups": 8}, "train": {"batch_prompts": 24}})
    assert cfg.trainer.trains_at_step and cfg.trainer.train_groups == 8
    with pytest.raises(ConfigError, match="trainer.train_groups .* is only used with trainer.filter_groups: true"):
        from_dict({"trainer": {"train_groups": 8}})
    with pytest.raises(ConfigError, match=r"trainer.train_groups \(20\) must be <= train.batch_prompts \(16\)"):
        from_dict({"trainer": {"filter_groups": True, "train_groups": 20}})
    with pytest.raises(ConfigError, match="train.group_size 1 leaves nothing to compare"):
        from_dict({"trainer": {"algorithm": "ppo", "filter_groups": True}, "train": {"group_size": 1}})
    with pytest.raises(ConfigError, match="verl's 'gen_batch_size' is train.batch_prompts"):
        from_dict({"trainer": {"gen_batch_size": 48}})


def test_the_gather_stages_its_bytes_on_the_rank_s_own_gpu(model_dir, monkeypatch):  # noqa: F811
    """Under NCCL ``all_gather_object`` moves the pickled ids to the calling thread's current
    GPU; ``step()`` runs on an RPC thread, which starts on GPU 0 on every rank
    (``workers.model.rank_device``), so the ranks of a node would all use GPU 0. The gather
    runs with the rank's own device current."""
    samples, prompts, sizes = build(model_dir, GROUPS)
    w = TrainerWorker(TrainerConfig(filter_groups=True, train_groups=3), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    w.world_size, w.device = 2, torch.device("cuda", 1)  # after the CPU work: what the gather sees
    current, seen = [], []

    @contextlib.contextmanager
    def device(d):
        current.append(torch.device(d))
        yield
        current.pop()

    def all_gather_object(out, obj, group=None):
        seen.append(current[-1] if current else None)
        out[:] = [obj, []]

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    w._filter_groups()
    assert seen == [torch.device("cuda", 1)]


def test_the_filter_needs_the_group_of_every_sample(model_dir):  # noqa: F811
    """ppo needs no groups, the filter does: a sample of a group with no size (``Sample.group_id``
    left at -1) would be one group with every other such sample."""
    samples, prompts, sizes = build(model_dir, GROUPS)
    w = TrainerWorker(TrainerConfig(algorithm="ppo", filter_groups=True), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, {})
    with pytest.raises(ValueError, match="group_id 0 has no size in begin_iteration .*trainer.filter_groups"):
        w.receive(samples)
