"""Sampler: next tokens for a batch of sequences, each with its own sampling parameters.

Per row: EOS is masked while the sequence has fewer than ``min_tokens`` outputs; then
``temperature < GREEDY_BELOW`` (1e-5, vLLM's bound) is greedy (argmax), otherwise
logits / temperature -> top-k -> top-p
-> a draw. Draws invert the CDF (float64 cumulative sum, one uniform per row, one
``searchsorted`` for the batch); the uniform of a request with ``seed`` comes from its own
``torch.Generator`` (reproducible whatever the batch), those of the others from the
engine's generator. On CPU, with the engine's compiled ops (the "cpu" attention backend),
a batch without top-k/top-p is drawn by one C++ pass per row (``cpu_ops.sample``: the same
formula and uniforms; ~0.1 ms instead of ~0.3 ms a decode step of workload (a)).

Returned log-prob: ``log_softmax`` of the logits the token was drawn from, i.e. after EOS
masking, temperature scaling and top-k/top-p filtering. Greedy rows report the model's
log-prob at temperature 1 (after EOS masking): a point mass would carry no information.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import is_

import torch

from workers.generation.sequence import Sequence
from workers.types import GREEDY_BELOW


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or CPU tensor) on ``device`` without a host sync (pinned, non-blocking
    copy on CUDA)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


@dataclass
class _Rows:
    """What a batch's rows ask for, kept while the same sequences are sampled step after step
    (their sampling parameters do not change; only EOS masking does)."""

    seqs: list[Sequence]
    params: list
    greedy: list[bool]
    filters: bool  # some sampled row asks for top-k or top-p
    greedy_t: torch.Tensor  # bool [B]
    temps_t: torch.Tensor  # fp32 [B]: greedy rows 1.0
    shared: bool  # every row draws from the engine's generator (none greedy, none seeded)


def cpu_seed(seed: int) -> int:
    """``seed`` (0 <= seed < 2**63) as torch's CPU generator can take it: that generator keeps a
    seed's low 32 bits only, so seeds 2**32 apart drew the same tokens (review, session 51; CUDA's
    Philox takes all 64). The high bits are folded into the low ones (splitmix64 of them); a seed
    below 2**32 is itself."""
    if not seed >> 32:
        return seed
    z = ((seed >> 32) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF  # splitmix64's finaliser
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (seed ^ z ^ (z >> 31)) & 0xFFFFFFFF


def generator(device, seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` (on CPU: ``cpu_seed``)."""
    return torch.Generator(device=device).manual_seed(cpu_seed(seed) if torch.device(device).type == "cpu" else seed)


class Sampler:
    def __init__(self, eos_ids: tuple[int, ...], device: torch.device, seed: int = 0, fused=None):
        """``fused``: the compiled ``cpu_ops`` module (CPU only): batches without top-k/top-p
        are drawn by its one-pass ``sample`` (same uniforms, same tokens up to rounding at a
        CDF boundary)."""
        self.device = device
        self.eos = torch.tensor(eos_ids, dtype=torch.int64, device=device) if eos_ids else None
        self.generator = generator(device, seed)
        self.fused = fused if torch.device(device).type == "cpu" else None
        self._no_eos = torch.empty(0, dtype=torch.int64)
        self._kept: _Rows | None = None

    def _rows(self, seqs: list[Sequence], vocab: int) -> _Rows:
        r = self._kept
        if r is not None and len(r.seqs) == len(seqs) and all(map(is_, seqs, r.seqs)):
            return r
        params = [s.request.sampling for s in seqs]
        greedy = [p.temperature < GREEDY_BELOW for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        self._kept = _Rows(seqs=list(seqs), params=params, greedy=greedy,
                           filters=self._filters(params, greedy, vocab), greedy_t=torch.tensor(greedy),
                           temps_t=torch.tensor(temps, dtype=torch.float32),
                           shared=not any(greedy) and all(p.seed is None for p in params))
        return self._kept

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.request.sampling.seed
        if seed is None:
            return None
        if seq.generator is None:
            seq.generator = generator(self.device, seed)
        return seq.generator

    def rewind(self, seq: Sequence) -> None:
        """Put ``seq``'s own generator back where its tokens so far left it (a step that failed
        may have drawn for it): re-seeded and advanced by one draw per sampled token, as
        ``_uniforms`` draws them (greedy rows draw none). Only on a failed step: O(tokens)."""
        seed, t = seq.request.sampling.seed, seq.request.sampling.temperature
        seq.generator = None
        if seed is None or t < GREEDY_BELOW:
            return
        g = self._generator(seq)
        for _ in range(seq.num_output):
            torch.rand(1, dtype=torch.float64, device=self.device, generator=g)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, V] -> (token ids int64 [B], log-probs float32 [B])."""
        # rows whose EOS is masked (fewer outputs than min_tokens)
        block = [s.num_output < s.request.min_tokens for s in seqs] if self.eos is not None else [False] * len(seqs)
        rows = self._rows(seqs, logits.shape[1])
        params, greedy = rows.params, rows.greedy
        if self.fused is not None and not rows.filters:
            u = self._uniforms(seqs, greedy, rows.shared)[:, 0]
            return self.fused.sample(logits.contiguous(), self.eos if self.eos is not None else self._no_eos,
                                     torch.tensor(block), rows.greedy_t, rows.temps_t, u)  # fp32 math inside
        logits = logits.float()
        if any(block):
            masked = to_device(block, torch.bool, logits.device)[:, None]  # [B, 1]
            eos_cols = logits.index_select(1, self.eos)
            logits.index_copy_(1, self.eos, eos_cols.masked_fill(masked, float("-inf")))
        if all(greedy):
            logp = torch.log_softmax(logits, dim=-1)
            ids = logits.argmax(-1)
            return ids, logp.gather(1, ids[:, None])[:, 0]
        logp = self._filtered_logprobs(logits, params, greedy)  # [B, V]
        # inverse-CDF draw: one uniform per row (cheap even for a 150k vocabulary)
        cdf = logp.exp().cumsum(-1, dtype=torch.float64)  # [B, V]
        u = self._uniforms(seqs, greedy, rows.shared)
        sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_(max=logp.shape[1] - 1)
        if any(greedy):
            sampled = torch.where(to_device(greedy, torch.bool, logp.device), logp.argmax(-1), sampled)
        return sampled, logp.gather(1, sampled[:, None])[:, 0]

    def _uniforms(self, seqs: list[Sequence], greedy: list[bool], all_shared: bool) -> torch.Tensor:
        """fp64 [B, 1]: a uniform for each sampled row (greedy rows: 0), from the request's
        own generator when it has a seed, else from the engine's (one draw for all of those).
        ``all_shared`` (``_Rows.shared``): every row draws from the engine's generator."""
        if all_shared:  # the common case
            return torch.rand(len(seqs), 1, dtype=torch.float64, device=self.device, generator=self.generator)
        shared = [i for i, s in enumerate(seqs) if not greedy[i] and self._generator(s) is None]
        u = torch.zeros(len(seqs), 1, dtype=torch.float64, device=self.device)
        if shared:
            idx = to_device(shared, torch.int64, self.device)
            u.index_copy_(0, idx, torch.rand(len(shared), 1, dtype=torch.float64, device=self.device,
                                             generator=self.generator))
        for i, s in enumerate(seqs):
            if not greedy[i] and s.generator is not None:
                u[i] = torch.rand(1, dtype=torch.float64, device=self.device, generator=s.generator)
        return u

    @staticmethod
    def _filters(params, greedy: list[bool], v: int) -> bool:
        """Whether a sampled row asks for top-k or top-p filtering."""
        return any(not g and (0 < p.top_k < v or p.top_p < 1.0) for p, g in zip(params, greedy))

    @staticmethod
    def _filtered_logprobs(logits: torch.Tensor, params, greedy: list[bool]) -> torch.Tensor:
        """logits: [B, V] -> log_softmax after temperature, top-k, top-p (greedy rows: T=1)."""
        dev, v = logits.device, logits.shape[1]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        if any(t != 1.0 for t in temps):
            logits = logits / to_device(temps, logits.dtype, dev)[:, None]
        top_k = [p.top_k if (0 < p.top_k < v and not g) else v for p, g in zip(params, greedy)]
        if min(top_k) < v:
            k = to_device(top_k, torch.int64, dev)
            kth = logits.topk(max(k_ for k_ in top_k if k_ < v), dim=-1).values  # [B, kmax]
            kth = torch.where(k[:, None] < v, kth.gather(1, (k.clamp(max=kth.shape[1]) - 1)[:, None]),
                              torch.full_like(kth[:, :1], float("-inf")))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        if min(top_p) < 1.0:
            p_t = to_device(top_p, logits.dtype, dev)[:, None]
            srt, order = logits.sort(dim=-1, descending=True)
            probs = srt.softmax(-1)
            # drop a token when the mass before it already reaches top_p (keeps at least one)
            drop = (probs.cumsum(-1) - probs) >= p_t
            drop &= p_t < 1.0  # a row of top_p 1 keeps all: its float32 cumsum reaches 1 before the tail
            drop[:, 0] = False  # the top token always (a top_p that rounds to 0 dropped every one: NaN)
            logits = logits.scatter(1, order, srt.masked_fill(drop, float("-inf")))
        return torch.log_softmax(logits, dim=-1)
