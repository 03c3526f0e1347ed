"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): the critic starts from the policy's backbone with a zero head, and reads each value
at the state before its token."""
import torch

from tests.trainer_helpers import tiny_config
from workers.model import CausalLM
from workers.trainer.critic import ValueModel
from workers.trainer.packing import pack


def test_the_value_model_starts_from_the_policys_backbone_with_a_zero_head():
    """critic.py: initialised from a policy's backbone (its weights copied), the head at 0, so
    every initial value is exactly 0."""
    torch.manual_seed(0)
    policy = CausalLM(tiny_config())
    torch.manual_seed(1)  # the critic's own random init must not leak into it
    critic = ValueModel(policy)
    mine, theirs = critic.model.state_dict(), policy.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    batch = pack([torch.tensor([11, 12, 13]), torch.tensor([14, 15])], [torch.tensor([20, 21]), torch.tensor([22])], "cpu")
    assert torch.equal(critic(batch), torch.zeros(3))


def test_a_value_is_read_at_the_state_before_its_token():
    """V(s_t): the value of response token t is the head on the hidden state of the token
    BEFORE it (the one that predicts it), each sequence alone, as the policy's logits are read."""
    from workers.model import CausalAttention

    torch.manual_seed(0)
    critic = ValueModel(CausalLM(tiny_config()))
    torch.nn.init.normal_(critic.value_head.weight)
    prompts, outputs = [torch.tensor([11, 12, 13]), torch.tensor([14, 15])], [torch.tensor([20, 21]), torch.tensor([22])]
    with torch.no_grad():
        got = critic(pack(prompts, outputs, "cpu"))
        want = []
        for p, o in zip(prompts, outputs):
            ids = torch.cat([p, o])
            hidden = critic.model(ids, torch.arange(len(ids)), CausalAttention([0, len(ids)]))
            want.append(critic.value_head(hidden[len(p) - 1:len(ids) - 1]).squeeze(-1))
    assert torch.allclose(got, torch.cat(want), atol=1e-5)
