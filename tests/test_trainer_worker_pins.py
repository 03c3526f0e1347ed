"""TrainerWorker behaviour one-line mutations changed unnoticed (mutation review, session 57): a
sample after step() refused (not trained alone at a second step), load_checkpoint mid-iteration
dropping its gradients and samples, a resume giving the CUDA generators their saved state."""
import pytest
import torch

from tests.test_trainer import make_samples, model_dir, task, weights  # noqa: F401
from workers.trainer import TrainerConfig, TrainerWorker


def test_a_sample_after_step_is_refused_not_trained_at_a_second_step(model_dir, task):  # noqa: F811
    samples, prompts, groups = make_samples(model_dir, task, groups=2, n=2, seed=1)
    w = TrainerWorker(TrainerConfig(lr=1e-2), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(samples[:-1])  # the last sample is late: its group is flushed incomplete at step()
    assert w.step().version == 1
    before = weights(w)
    with pytest.raises(RuntimeError, match="was stepped; begin_iteration"):
        w.receive(samples[-1:])
    with pytest.raises(RuntimeError, match="was stepped"):
        w.extend_iteration({}, {})
    assert w.version == 1 and not w._trained_any and not w.buffer.pending
    assert all(torch.equal(before[k], v) for k, v in weights(w).items())


@pytest.mark.parametrize("kw", [{}, dict(mini_batches=2), dict(ppo_epochs=2)])
def test_loading_a_checkpoint_mid_iteration_drops_its_gradients_and_samples(model_dir, task, tmp_path, kw):  # noqa: F811
    """load_checkpoint resets the iteration: gradients accumulated by micro-batches trained during
    receive must not be summed into the next step after the load; with mini_batches > 1 or
    ppo_epochs > 1 the micro-batches kept for step() are dropped too, or the next step trained the
    abandoned samples again (mutation review, s59)."""
    cfg = TrainerConfig(lr=1e-2, max_tokens_per_microbatch=40, **kw)  # small: micro-batches train in receive
    s0, p0, g0 = make_samples(model_dir, task, groups=2, n=2, seed=1)
    ck = str(tmp_path / "ck")
    a = TrainerWorker(cfg, model_dir, task, device="cpu")
    a.save_checkpoint(ck)
    a.begin_iteration(0, p0, g0)
    a.receive(s0[:3])
    assert a._trained_any or a.trained_batches  # gradients, or micro-batches kept for step()
    a.load_checkpoint(ck)
    b = TrainerWorker(cfg, model_dir, task, device="cpu")
    b.load_checkpoint(ck)
    for w in (a, b):
        w.begin_iteration(0, p0, g0)
        w.receive(s0)
        w.step()
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resume_gives_the_cuda_generators_their_saved_state(model_dir, task, tmp_path, monkeypatch):  # noqa: F811
    """clip_cov draws its tokens with torch.rand on the loss's device: on a GPU that is the CUDA
    generator. A fake CUDA (is_available / get_rng_state_all / set_rng_state_all patched: the
    CPU-only suite has no GPU to give a real one) records what the resume sets."""
    saved = [torch.arange(16, dtype=torch.uint8)]
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in saved])
    got = []
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: got.append([t.clone() for t in states]))
    w.save_checkpoint(str(tmp_path / "ck"))
    w.load_checkpoint(str(tmp_path / "ck"))
    assert len(got) == 1 and torch.equal(got[0][0], saved[0])


# ---- mutation review, session 59 ------------------------------------------------------------
def test_begin_iteration_refuses_gradients_trained_but_not_stepped(model_dir, task):  # noqa: F811
    """Every sample trained during receive (a 1-token micro-batch budget): nothing is pending, but
    the gradients are; a begin_iteration before step() would sum them into the next iteration."""
    s0, p0, g0 = make_samples(model_dir, task, groups=2, n=2, seed=1)
    w = TrainerWorker(TrainerConfig(lr=1e-2, max_tokens_per_microbatch=1), model_dir, task, device="cpu")
    w.begin_iteration(0, p0, g0)
    w.receive(s0)
    assert w._trained_any and w.buffer.pending == 0
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        w.begin_iteration(1, p0, g0)


def test_the_critic_steps_at_critic_lr_not_the_actors_lr(model_dir, task):  # noqa: F811
    """trainer.critic_lr is the critic's parameter group's rate (the warm-up test sets both to 1e-2)."""
    samples, prompts, groups = make_samples(model_dir, task, groups=2, n=2, seed=1)
    w = TrainerWorker(TrainerConfig(algorithm="ppo", lr=1e-2, critic_lr=1e-4), model_dir, task, device="cpu")
    assert w.scheduler.base_lrs == [1e-2, 1e-4]
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    assert w.step().metrics["lr"] == pytest.approx(1e-2)
    assert w.optimizer.param_groups[1]["lr"] == pytest.approx(1e-4)
