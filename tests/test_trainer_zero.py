"""``trainer.shard_optimizer`` (ZeRO-1, ``workers/trainer/optimizer.py``): 2 data-parallel ranks
(gloo, local processes) give the same weights sharded as unsharded, each rank holding about
half of the AdamW state; a sharded checkpoint is plain AdamW's state and resumes either way."""
import pytest
import torch

from workers.tasks import make_task
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.optimizer import local_state_elements, sharded
from workers.trainer.rollout import rollout
from workers.weight_sync.localrun import run_local
from tests.runtime_helpers import TASK, iterations, tiny_model, torchrun, write_config  # noqa: F401
from tests.trainer_helpers import LengthRewardTask, tiny_config

# several updates a step
ALGOS = [dict(algorithm="grpo", kl_coef=0.05, mini_batches=2), dict(algorithm="ppo", ppo_epochs=2)]


def _task():
    return LengthRewardTask(make_task("synthetic", max_terms=3, num_train=64, num_test=16))


def _cfg(shard: bool, **kw) -> TrainerConfig:
    return TrainerConfig(**dict(kw, lr=1e-2, weight_decay=0.01, max_tokens_per_microbatch=48, shard_optimizer=shard,
                                warmup_steps=1, lr_schedule="cosine", total_steps=4))


def _iterate(w: TrainerWorker, rank: int, world: int, data, iterations: int):
    samples, prompts, groups = data
    for it in range(iterations):
        w.begin_iteration(it, prompts, groups)
        w.receive([s for s in samples if s.group_id % world == rank])  # whole groups per rank
        res = w.step()
    return res


def _weights(w: TrainerWorker) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in w.named_weights()}
    if w.critic is not None:
        out.update({f"critic.{k}": v.detach().clone() for k, v in w.critic.state_dict().items()})
    return out


def _ranks(rank, world, model_dir, data, ckpt_dir):
    """Per algorithm: sharded and unsharded workers after 2 iterations, their state sizes; then a
    sharded checkpoint (rank 0 writes) and a sharded worker resumed from an unsharded one."""
    out = {}
    for kw in ALGOS:
        name = kw["algorithm"]
        res = {}
        for shard in (False, True):
            w = TrainerWorker(_cfg(shard, **kw), model_dir, _task(), rank=rank, world_size=world, device="cpu")
            assert sharded(w.optimizer) is shard
            r = _iterate(w, rank, world, data, 2)
            res[shard] = (_weights(w), r.version, local_state_elements(w.optimizer))
            w.save_checkpoint(f"{ckpt_dir}/{name}_{'zero' if shard else 'plain'}")  # every rank calls it
            if shard:  # rank 0 keeps no gathered copy of the others' shares
                res["kept_after_save"] = len(w.optimizer._all_state_dicts)
            if shard:  # a third iteration from here, to compare with the resumed workers below
                _iterate(w, rank, world, data, 1)
                res["third"] = _weights(w)
        # resume sharded from the unsharded checkpoint: the same third iteration
        w = TrainerWorker(_cfg(True, **kw), model_dir, _task(), rank=rank, world_size=world, device="cpu")
        w.load_checkpoint(f"{ckpt_dir}/{name}_plain")
        # this rank's share only, in the inner AdamW (torch's wrapper kept a second copy)
        res["after_load"] = (len(w.optimizer.state), local_state_elements(w.optimizer))
        _iterate(w, rank, world, data, 1)
        res["resumed_sharded"] = _weights(w)
        out[name] = res
    return out


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("zero")
    model_dir = str(build_model_dir(tmp / "m", _task().base, tiny_config(), seed=0)[0])
    ref = TrainerWorker(TrainerConfig(), model_dir, _task(), device="cpu")
    data = rollout(ref.actor, ref.tokenizer, _task().prompts("train")[:4], 3, 12, seed=5)
    ranks = run_local(2, _ranks, model_dir, data, str(tmp / "ckpt"))
    return model_dir, data, tmp / "ckpt", ranks


@pytest.mark.parametrize("algo", [kw["algorithm"] for kw in ALGOS])
def test_sharded_update_equals_unsharded_with_half_the_state(ran, algo):
    _, _, _, ranks = ran
    plain, zero = ranks[0][algo][False], ranks[0][algo][True]
    assert plain[1] == zero[1] == 2  # two updates applied
    assert plain[0].keys() == zero[0].keys()
    for k in plain[0]:
        assert torch.equal(plain[0][k], zero[0][k]), k  # AdamW is elementwise: the same bits
    for k in zero[0]:  # and the ranks agree (each broadcast its share)
        assert torch.equal(zero[0][k], ranks[1][algo][True][0][k]), k
    whole = plain[2]
    shares = [ranks[r][algo][True][2] for r in (0, 1)]
    assert ranks[1][algo][False][2] == whole  # unsharded: every rank holds all of it
    assert sum(shares) == whole  # sharded: each element on one rank only
    assert max(shares) <= 0.75 * whole, shares  # whole tensors packed greedily: about half each


@pytest.mark.parametrize("algo", [kw["algorithm"] for kw in ALGOS])
def test_sharded_checkpoint_is_plain_adamw_state(ran, algo):
    model_dir, data, ckpt, ranks = ran
    zero = torch.load(ckpt / f"{algo}_zero" / "trainer_state.pt", weights_only=False)["optimizer"]
    plain = torch.load(ckpt / f"{algo}_plain" / "trainer_state.pt", weights_only=False)["optimizer"]
    assert zero["state"].keys() == plain["state"].keys()
    for i in plain["state"]:
        for key, v in plain["state"][i].items():
            assert torch.equal(zero["state"][i][key], v), (i, key)
    assert [g["params"] for g in zero["param_groups"]] == [g["params"] for g in plain["param_groups"]]
    # an unsharded rank resumes from the sharded checkpoint (one rank here: the same state)
    w = TrainerWorker(_cfg(False, **next(kw for kw in ALGOS if kw["algorithm"] == algo)), model_dir, _task(),
                      device="cpu")
    w.load_checkpoint(str(ckpt / f"{algo}_zero"))
    assert w.version == 2
    assert local_state_elements(w.optimizer) == ranks[0][algo][False][2]


@pytest.mark.parametrize("algo", [kw["algorithm"] for kw in ALGOS])
def test_sharded_rank_resumes_from_an_unsharded_checkpoint(ran, algo):
    ranks = ran[3]
    for r in (0, 1):
        assert ranks[r][algo]["kept_after_save"] == 0
        wrapper, share = ranks[r][algo]["after_load"]
        assert wrapper == 0 and share == ranks[r][algo][True][2] > 0
        resumed, third = ranks[r][algo]["resumed_sharded"], ranks[r][algo]["third"]
        for k in third:
            assert torch.equal(resumed[k], third[k]), (r, k)


def test_one_rank_has_nothing_to_shard(tmp_path):
    model_dir = str(build_model_dir(tmp_path / "m", _task().base, tiny_config(), seed=0)[0])
    w = TrainerWorker(_cfg(True, algorithm="grpo"), model_dir, _task(), device="cpu")
    assert not sharded(w.optimizer)


def test_shard_optimizer_is_a_switch():
    with pytest.raises(ValueError, match="trainer.shard_optimizer: expected bool, got str 'yes'"):
        TrainerConfig(shard_optimizer="yes")


def test_a_run_with_two_sharded_trainer_ranks_checkpoints_the_whole_state(tmp_path, tiny_model):  # noqa: F811
    """The controller asks every trainer rank to save: rank 0 gathers the shares (a collective;
    asking rank 0 alone left it waiting for its peer until the collective timeout)."""
    cfg = write_config(tmp_path, tiny_model, trainer__shard_optimizer=True, placement__trainer=[2, 3],
                       placement__collective_timeout_s=60, train__iterations=2, train__eval_every=0,
                       train__ckpt_every=1)
    p = torchrun(cfg, nproc=4, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert [r["iteration"] for r in iterations(tmp_path / "run")] == [0, 1]
    saved = tmp_path / "run" / "checkpoints" / "iter_000002" / "trainer"
    state = torch.load(saved / "trainer_state.pt", weights_only=False)["optimizer"]
    w = TrainerWorker(TrainerConfig(algorithm="grpo", lr=1e-3), tiny_model, make_task("synthetic", **TASK),
                      device="cpu")
    assert sorted(state["state"]) == list(range(len(list(w.actor.parameters()))))  # every parameter's moments
    w.load_checkpoint(str(saved))
    assert w.version == 2


def test_one_trainer_rank_is_said_to_keep_the_whole_state():
    from controller.config import from_dict
    from controller.config_notes import config_notes

    one = from_dict({"trainer": {"shard_optimizer": True}})
    assert any("placement.trainer has one: it keeps all of it" in n for n in config_notes(one))
    two = from_dict({"trainer": {"shard_optimizer": True}, "placement": {"generation": [1], "trainer": [2, 3]}}, 4)
    assert two.trainer.shard_optimizer and not any("shard_optimizer" in n for n in config_notes(two))


def test_verls_optimizer_offload_points_to_shard_optimizer():
    from controller.config import ConfigError, from_dict

    with pytest.raises(ConfigError, match="trainer.shard_optimizer: true shards the AdamW state"):
        from_dict({"trainer": {"optimizer_offload": True}})


def test_the_trainers_save_after_the_push_in_flight_ends():
    """``Program.save_trainers``: the lag-1 modes record, and save, an iteration while its weight
    push is in flight; a save gathers over the trainer group (the RNG states always, a sharded
    optimizer's shares), which must not run beside the push's sends. The push is waited for
    before any rank is asked to save, whatever the trainer config (only a sharded optimizer's save
    waited until session 55), and a push already waited for (or failed) is not waited again."""
    import threading
    from types import SimpleNamespace

    from controller.program import Program

    order = []

    import torch

    from controller.rpc import Call

    class Trainer:  # stands in for a WorkerHandle: a real Call over a settled torch future
        rank, role, name, alive = 2, "trainer", "worker2", True

        def call(self, method, folder):
            order.append(method)
            fut = torch.futures.Future()
            fut.set_result(folder)
            return Call(self, method, fut)

    p = Program.__new__(Program)
    p.world = SimpleNamespace(trainers=[Trainer(), Trainer()])
    assert p.save_trainers("ck") == "ck" and order == ["save_checkpoint"] * 2  # no push yet
    order.clear()
    push = SimpleNamespace(waiting=SimpleNamespace(cancelled=threading.Event()),
                           wait=lambda prog: order.append("push waited"))
    p._last_push = push
    p.save_trainers("ck")
    assert order == ["push waited", "save_checkpoint", "save_checkpoint"]
    order.clear()
    push.waiting.cancelled.set()  # what _wait_push leaves behind, done or failed
    p.save_trainers("ck")
    assert order == ["save_checkpoint"] * 2
