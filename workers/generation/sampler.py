"""Sampler: next tokens for a batch of sequences, each with its own sampling parameters.

Per row: EOS is masked while the sequence has fewer than ``min_tokens`` outputs; then
``temperature == 0`` is greedy (argmax), otherwise logits / temperature -> top-k -> top-p
-> a draw. Draws use the exponential race (argmax of p / E, E ~ Exp(1), same law as a
categorical draw) so a whole batch samples in one argmax; the noise of a request with
``seed`` comes from its own ``torch.Generator`` (reproducible whatever the batch), that of
the others from the engine's generator.

Returned log-prob: ``log_softmax`` of the logits the token was drawn from, i.e. after EOS
masking, temperature scaling and top-k/top-p filtering. Greedy rows report the model's
log-prob at temperature 1 (after EOS masking): a point mass would carry no information.
"""
from __future__ import annotations

import torch

from workers.generation.sequence import Sequence


class Sampler:
    def __init__(self, eos_ids: tuple[int, ...], device: torch.device, seed: int = 0):
        self.device = device
        self.eos = torch.tensor(eos_ids, dtype=torch.int64, device=device) if eos_ids else None
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.request.sampling.seed
        if seed is None:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        return seq.generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] -> (token ids int64 [B], log-probs float32 [B])."""
        logits = logits.float()
        if self.eos is not None:
            block = [s.num_output < s.request.min_tokens for s in seqs]
            if any(block):
                rows = torch.tensor(block, device=logits.device)[:, None]  # [B, 1]
                eos_cols = logits.index_select(1, self.eos)
                logits.index_copy_(1, self.eos, eos_cols.masked_fill(rows, float("-inf")))
        params = [s.request.sampling for s in seqs]
        greedy = [p.temperature <= 0 for p in params]
        if all(greedy):
            logp = torch.log_softmax(logits, dim=-1)
            ids = logits.argmax(-1)
            return ids, logp.gather(1, ids[:, None])[:, 0]
        logp = self._filtered_logprobs(logits, params, greedy)
        noise = torch.empty_like(logp)
        shared = [i for i, s in enumerate(seqs) if not greedy[i] and self._generator(s) is None]
        if shared:
            idx = torch.tensor(shared, device=logp.device)
            noise.index_copy_(0, idx, torch.empty(len(shared), logp.shape[1], device=logp.device)
                              .exponential_(generator=self.generator))
        for i, s in enumerate(seqs):
            if not greedy[i] and s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        sampled = (logp - noise.log()).argmax(-1)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=logp.device), logp.argmax(-1), sampled)
        return sampled, logp.gather(1, sampled[:, None])[:, 0]

    @staticmethod
    def _filtered_logprobs(logits: torch.Tensor, params, greedy: list[bool]) -> torch.Tensor:
        """logits: [B, V] -> log_softmax after temperature, top-k, top-p (greedy rows: T=1)."""
        dev, v = logits.device, logits.shape[1]
        temp = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=dev)
        logits = logits / temp[:, None]
        top_k = [p.top_k if (0 < p.top_k < v and not g) else v for p, g in zip(params, greedy)]
        if min(top_k) < v:
            k = torch.tensor(top_k, device=dev)
            kth = logits.topk(max(k_ for k_ in top_k if k_ < v), dim=-1).values  # [B, kmax]
            kth = torch.where(k[:, None] < v, kth.gather(1, (k.clamp(max=kth.shape[1]) - 1)[:, None]),
                              torch.full_like(kth[:, :1], float("-inf")))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        if min(top_p) < 1.0:
            p_t = torch.tensor(top_p, device=dev)[:, None]
            srt, order = logits.sort(dim=-1, descending=True)
            probs = srt.softmax(-1)
            # drop a token when the mass before it already reaches top_p (keeps at least one)
            drop = (probs.cumsum(-1) - probs) >= p_t
            logits = logits.scatter(1, order, srt.masked_fill(drop, float("-inf")))
        return torch.log_softmax(logits, dim=-1)
