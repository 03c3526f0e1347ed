"""``trainer.critic_warmup`` (verl's): with ppo, the actor trains from iteration N on (counted
from 1, as verl's global steps); the N - 1 iterations before it update only the critic. The
actor's LR schedule starts when the actor does, as verl's actor scheduler steps only with it."""
import pytest
import torch

from trainer_helpers import LengthRewardTask, synthetic_task, tiny_model_dir
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.rollout import rollout
from workers.trainer.schedule import lr_lambda

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def task():
    return LengthRewardTask(synthetic_task())


def _iterations(model_dir, task, n):
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    out = []
    for it in range(n):
        samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[2 * it:2 * it + 2], 3, 10,
                                           version=it, seed=it)
        out.append((samples, prompts, groups))
    return out


def _state(m):
    return [p.detach().clone() for p in m.parameters()]


def _train(w, it, batch):
    samples, prompts, groups = batch
    w.begin_iteration(it, prompts, groups)
    w.receive(samples)
    return w.step()


CFG = dict(algorithm="ppo", lr=1e-2, critic_lr=1e-2, lr_schedule="cosine", warmup_steps=1, total_steps=6)


def test_the_first_n_minus_one_iterations_train_only_the_critic(model_dir, task):
    batches = _iterations(model_dir, task, 4)
    w = TrainerWorker(TrainerConfig(critic_warmup=3, **CFG), model_dir, task, device="cpu")
    f = lr_lambda(TrainerConfig(**CFG))
    for it, batch in enumerate(batches):
        actor, critic = _state(w.actor), _state(w.critic)
        res = _train(w, it, batch)
        frozen = it < 2  # verl's steps 1 and 2 (critic_warmup 3 <= step: from step 3)
        assert res.metrics["actor_frozen"] == float(frozen) and res.metrics["updates"] == 1
        assert all(torch.equal(a, b) for a, b in zip(actor, _state(w.actor))) == frozen, it
        assert not all(torch.equal(a, b) for a, b in zip(critic, _state(w.critic)))  # the critic always trains
        assert res.version == it + 1  # the engines take the (unchanged) weights as a new version
        # the actor's schedule starts at its first update; the critic's ran from the first iteration
        assert res.metrics["lr"] == pytest.approx(1e-2 * f(max(0, it - 2)))
        assert w.optimizer.param_groups[1]["lr"] == pytest.approx(1e-2 * f(it + 1))
    plain = TrainerWorker(TrainerConfig(**CFG), model_dir, task, device="cpu")
    actor = _state(plain.actor)
    assert "actor_frozen" not in _train(plain, 0, batches[0]).metrics  # no warm-up: the actor trains at once
    assert not all(torch.equal(a, b) for a, b in zip(actor, _state(plain.actor)))


def test_a_resume_inside_the_warmup_continues_it(model_dir, task, tmp_path):
    batches = _iterations(model_dir, task, 3)
    cfg = TrainerConfig(critic_warmup=3, **CFG)
    a = TrainerWorker(cfg, model_dir, task, device="cpu")
    _train(a, 0, batches[0])
    a.save_checkpoint(str(tmp_path / "ckpt"))
    ra = [_train(a, it, batches[it]) for it in (1, 2)]
    b = TrainerWorker(cfg, model_dir, task, device="cpu")
    b.load_checkpoint(str(tmp_path / "ckpt"))
    rb = [_train(b, it, batches[it]) for it in (1, 2)]
    assert [r.metrics["actor_frozen"] for r in rb] == [1.0, 0.0]
    assert [r.metrics["lr"] for r in ra] == [r.metrics["lr"] for r in rb]
    assert all(torch.equal(x, y) for x, y in zip(_state(a.actor), _state(b.actor)))
    assert all(torch.equal(x, y) for x, y in zip(_state(a.critic), _state(b.critic)))


@pytest.mark.parametrize("warmup, frozen", [(0, 0), (1, 0), (2, 1), (5, 4)])
def test_verls_count(warmup, frozen):
    assert TrainerConfig(algorithm="ppo", critic_warmup=warmup).critic_only_iterations == frozen


def test_without_a_critic_it_is_refused():
    with pytest.raises(ValueError, match=r"trainer.critic_warmup \(2\) warms up a critic, which only algorithm 'ppo' "
                                         r"has, not 'grpo' \(verl keeps the actor"):
        TrainerConfig(algorithm="grpo", critic_warmup=2)


def test_the_actors_schedule_counts_its_own_updates_across_a_resume_that_changes_the_warmup(model_dir, task, tmp_path):
    """The actor's schedule step was the scheduler's minus a fixed warm-up: a resume with another
    critic_warmup put the actor at the wrong step (3 instead of 1 here; a longer warm-up on
    resume made its lr go back). It counts the steps that updated the actor, saved with them."""
    cfg = dict(CFG, lr_schedule="linear", warmup_steps=0)
    f = lr_lambda(TrainerConfig(**cfg))
    batches = _iterations(model_dir, task, 4)
    a = TrainerWorker(TrainerConfig(critic_warmup=3, **cfg), model_dir, task, device="cpu")
    for it in range(3):  # 0 and 1 critic-only, 2 the actor's first update
        _train(a, it, batches[it])
    assert a.actor_steps == 1
    a.save_checkpoint(str(tmp_path / "ckpt"))
    b = TrainerWorker(TrainerConfig(critic_warmup=0, **cfg), model_dir, task, device="cpu")
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.actor_steps == 1
    res = _train(b, 3, batches[3])  # the actor's second update: its schedule's step 1
    assert res.metrics["lr"] == pytest.approx(1e-2 * f(1)) and f(1) != f(3)
    assert b.optimizer.param_groups[1]["lr"] == pytest.approx(1e-2 * f(4))  # the critic's: every step
