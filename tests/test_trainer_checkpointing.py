"""``trainer.activation_checkpointing``: the same update, less activation memory kept for backward."""
import pytest
import torch

from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.packing import pack, response_logits, token_logprobs
from workers.trainer.rollout import rollout
from tests.trainer_helpers import LengthRewardTask, synthetic_task, tiny_config, tiny_model_dir

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory, tiny_config(layers=4, hidden=64, heads=4, kv_heads=2)), \
        LengthRewardTask(synthetic_task())


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_same_update_with_and_without_checkpointing(setup, algorithm):
    model_dir, task = setup
    after, before = [], None
    for ckpt in (False, True):
        w = TrainerWorker(TrainerConfig(algorithm=algorithm, lr=1e-2, activation_checkpointing=ckpt, seed=0),
                          model_dir, task, device="cpu")
        before = before or {k: v.detach().clone() for k, v in w.actor.named_parameters()}
        samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:4], 3, 10, seed=3)
        w.begin_iteration(0, prompts, groups)
        w.receive(samples)
        w.step()
        params = dict(w.actor.named_parameters())
        if w.critic is not None:
            params.update({f"critic.{k}": v for k, v in w.critic.named_parameters()})
        after.append({k: v.detach().clone() for k, v in params.items()})
    for k in after[0]:
        assert torch.allclose(after[0][k], after[1][k], atol=1e-6, rtol=1e-5), k
    moved = max((after[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4, moved  # the actor trained (equal rewards would leave both runs unmoved)


def saved_bytes(model, batch) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward + log-prob."""
    total = 0

    def pack_hook(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        token_logprobs(response_logits(model, batch), batch.resp_ids).sum()
    return total


def test_checkpointing_keeps_less_for_backward(setup):
    model_dir, task = setup
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    g = torch.Generator().manual_seed(0)
    v = w.actor.config.vocab_size
    batch = pack([torch.randint(0, v, (200,), generator=g)] * 4, [torch.randint(0, v, (56,), generator=g)] * 4, "cpu")
    full = saved_bytes(w.actor, batch)
    w.actor.model.checkpoint_layers = True
    ckpt = saved_bytes(w.actor, batch)
    assert ckpt < 0.5 * full, (ckpt, full)
    with torch.no_grad():  # inference (reference, engine) never recomputes
        assert saved_bytes(w.actor, batch) == 0
