"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): shuffled mini-batches change order from step to step."""
from tests.test_trainer_mini_batches import cfg, setup  # noqa: F401
from workers.trainer import TrainerWorker, updates
from workers.trainer.rollout import rollout


def test_shuffled_mini_batches_take_a_new_order_every_step(setup, monkeypatch):  # noqa: F811
    """shuffle (default): the groups' order across mini-batches is drawn anew at each step
    (seed and weight version), not the same permutation every step."""
    model_dir, task = setup
    orders, real = [], updates.mini_batch_shares

    def spy(items, k, seed):
        shares = real(items, k, seed)
        orders.append([p.group_id for share in shares for p in share])
        return shares

    monkeypatch.setattr(updates, "mini_batch_shares", spy)
    w = TrainerWorker(cfg(mini_batches=2, max_staleness=10), model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:8], 2, 6, seed=5)
    for it in range(3):
        w.begin_iteration(it, prompts, groups)
        w.receive(samples)
        w.step()
    assert len(orders) == 3 and len({tuple(o) for o in orders}) > 1
