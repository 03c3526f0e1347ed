"""Value model: the policy's Backbone architecture with a scalar head, for GAE."""
from __future__ import annotations

import torch
from torch import nn

from workers.model import Backbone, CausalLM
from workers.trainer.packing import Packed, attention_for


class ValueModel(nn.Module):
    """``forward(batch: Packed) -> values [N]`` at the response positions: V(s_t), the value of
    the state before response token t. Initialised from a policy's backbone (its head at 0)."""

    def __init__(self, policy: CausalLM):
        super().__init__()
        self.config = policy.config
        self.model = Backbone(policy.config).to(next(policy.parameters()).device)
        self.model.load_state_dict(policy.model.state_dict())
        self.value_head = nn.Linear(policy.config.hidden_size, 1).to(self.model.norm.weight.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, batch: Packed) -> torch.Tensor:
        hidden = self.model(batch.ids, batch.positions, attention_for(batch))  # [T, D]
        return self.value_head(hidden[batch.resp_pos]).squeeze(-1).float()  # [N]
