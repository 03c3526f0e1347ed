"""Pack prompt+response sequences for one forward and pick out the response positions."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.model import CausalAttention, CausalLM


@dataclass
class Packed:
    """B sequences laid end to end (T tokens), N response tokens among them.

    ids, positions: [T]; cu: B+1 offsets; resp_pos: [N] positions whose hidden state
    predicts a response token; resp_ids: [N] those tokens; seq_index: [N] (0..B-1);
    seq_lens: [B] response lengths; eos_blocked: [N] bool, the response positions before their
    sequence's ``min_tokens`` (None when there are none)."""

    ids: torch.Tensor
    positions: torch.Tensor
    cu: list[int]
    resp_pos: torch.Tensor
    resp_ids: torch.Tensor
    seq_index: torch.Tensor
    seq_lens: torch.Tensor
    eos_blocked: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.resp_ids.numel())


def pack(prompts: list[torch.Tensor], outputs: list[torch.Tensor], device: torch.device,
         min_tokens: list[int] | None = None) -> Packed:
    """prompts[b]: [P_b], outputs[b]: [L_b] (L_b >= 1) -> Packed. ``min_tokens[b]``: EOS was
    masked for output[b]'s first min_tokens[b] tokens when they were sampled."""
    empty = [b for b, p in enumerate(prompts) if len(p) == 0]
    if empty:  # output[0] would be predicted from the sequence before (b = 0: the batch's last token)
        raise ValueError(f"pack: prompt {empty[0]} has no tokens; a response is predicted from its prompt's last")
    seqs = [torch.cat([p.long().cpu(), o.long().cpu()]) for p, o in zip(prompts, outputs)]
    cu, resp_pos, seq_index = [0], [], []
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        start = cu[-1] + len(p) - 1  # hidden at the last prompt token predicts output[0]
        resp_pos.append(torch.arange(start, start + len(o)))
        seq_index.append(torch.full((len(o),), b))
        cu.append(cu[-1] + len(p) + len(o))
    return Packed(
        ids=torch.cat(seqs).to(device),
        positions=torch.cat([torch.arange(len(s)) for s in seqs]).to(device),
        cu=cu,
        resp_pos=torch.cat(resp_pos).to(device),
        resp_ids=torch.cat([o.long().cpu() for o in outputs]).to(device),
        seq_index=torch.cat(seq_index).to(device),
        seq_lens=torch.tensor([len(o) for o in outputs], device=device),
        eos_blocked=(torch.cat([torch.arange(len(o)) < m for o, m in zip(outputs, min_tokens)]).to(device)
                     if min_tokens and any(min_tokens) else None),
    )


class PaddedCausalAttention:
    """Same result as ``CausalAttention(cu)``, computed per sequence on a padded
    ``[B, H, S_max, Dh]`` batch: cost B * S_max^2 instead of T^2 for T packed tokens (a
    packed batch of many short sequences is mostly masked-out work otherwise)."""

    def __init__(self, cu: list[int], device: torch.device):
        lens = torch.tensor(cu).diff()
        self.b, self.s = len(lens), int(lens.max())
        seq = torch.repeat_interleave(torch.arange(self.b), lens)
        off = torch.arange(cu[-1]) - torch.tensor(cu[:-1]).repeat_interleave(lens)
        self.flat = (seq * self.s + off).to(device)  # [T] index into [B * S_max]
        pos = torch.arange(self.s)
        valid = pos[None, :] < lens[:, None]  # [B, S]
        causal = pos[:, None] >= pos[None, :]  # [S, S]
        self.mask = (causal[None] & valid[:, None, :])[:, None].to(device)  # [B, 1, S, S]

    def _pad(self, x: torch.Tensor) -> torch.Tensor:  # [T, H, Dh] -> [B, H, S, Dh]
        out = x.new_zeros(self.b * self.s, *x.shape[1:])
        out[self.flat] = x
        return out.view(self.b, self.s, *x.shape[1:]).transpose(1, 2)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qp, kp, vp = self._pad(q), self._pad(k), self._pad(v)
        out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=self.mask,
                                             enable_gqa=qp.shape[1] != kp.shape[1])  # [B, H, S, Dh]
        return out.transpose(1, 2).reshape(self.b * self.s, *q.shape[1:])[self.flat]


def attention_for(batch: Packed):
    """Padded per-sequence attention when it is cheaper than one packed T x T attention."""
    return attention_over(batch.cu, batch.ids.device)


def attention_over(cu: list[int], device: torch.device):
    """``attention_for`` of packed sequences with offsets ``cu`` (``[0, len0, len0 + len1, ...]``)."""
    lens = torch.tensor(cu).diff()
    if len(lens) > 1 and len(lens) * int(lens.max()) ** 2 < cu[-1] ** 2:
        return PaddedCausalAttention(cu, device)
    return CausalAttention(cu)


def response_logits(model: CausalLM, batch: Packed) -> torch.Tensor:
    """-> logits [N, V] (float32) at the response positions only."""
    hidden = model(batch.ids, batch.positions, attention_for(batch))  # [T, D]
    return model.logits(hidden[batch.resp_pos]).float()  # [N, V]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logits: [N, V], ids: [N] -> log pi(ids) [N]."""
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
