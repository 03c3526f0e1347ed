"""A small reference sampler (dense per-sequence KV cache) for SFT evaluation and tests.

Not the engine: the Stream Generation Service uses ``workers/generation`` (paged KV cache,
continuous batching). This is the simplest correct sampler over the model's attention-backend
protocol, so the trainer package can evaluate rewards without depending on the engine.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from workers.model import CausalAttention, CausalLM
from workers.tasks.scoring import as_score
from workers.types import Sample, TaskPrompt


class DenseKVCache:
    """Attention backend: B sequences, contiguous caches ``k, v: [layers, B, S, Hkv, Dh]``.

    Prefill: packed prompts (``cu``), causal within each. Decode: one token per sequence at
    position ``lens[b]``."""

    def __init__(self, model: CausalLM, batch: int, max_len: int):
        c = model.config
        p = next(model.parameters())
        shape = (c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.dim_head)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros_like(self.k)
        self.lens = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.cu: list[int] | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.cu is not None:  # prefill: q, k, v: [T, *, Dh] packed
            for b in range(len(self.cu) - 1):
                s, e = self.cu[b], self.cu[b + 1]
                self.k[layer, b, : e - s] = k[s:e]
                self.v[layer, b, : e - s] = v[s:e]
            return CausalAttention(self.cu)(layer, q, k, v)
        rows = torch.arange(q.shape[0], device=q.device)  # decode: q: [B, H, Dh], k/v: [B, Hkv, Dh]
        self.k[layer, rows, self.lens] = k
        self.v[layer, rows, self.lens] = v
        span = int(self.lens.max()) + 1
        keys = self.k[layer, :, :span].transpose(1, 2)  # [B, Hkv, S, Dh]
        vals = self.v[layer, :, :span].transpose(1, 2)
        mask = (torch.arange(span, device=q.device)[None, :] <= self.lens[:, None])[:, None, None, :]  # [B,1,1,S]
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, vals, attn_mask=mask,
                                             enable_gqa=q.shape[1] != keys.shape[1])
        return out[:, :, 0, :]  # [B, H, Dh]

    def keep(self, idx: torch.Tensor) -> None:
        self.k, self.v, self.lens = self.k[:, idx], self.v[:, idx], self.lens[idx]


@torch.no_grad()
def generate(model: CausalLM, prompts: Sequence[Sequence[int] | torch.Tensor], max_tokens: int,
             eos_id: int | None, temperature: float = 1.0, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """Sample a completion per prompt -> [(output_ids [L], logprobs [L], finish_reason)].

    The EOS token, when sampled, ends the output and is part of it. ``temperature == 0``: greedy."""
    dev = next(model.parameters()).device
    seqs = [torch.as_tensor(p, dtype=torch.long).cpu() for p in prompts]
    if not seqs:
        return []
    if any(len(s) == 0 for s in seqs):
        raise ValueError("generate: empty prompt")
    B = len(seqs)
    cache = DenseKVCache(model, B, max(len(s) for s in seqs) + max_tokens)
    gen = torch.Generator(device=dev).manual_seed(seed)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    cache.cu = cu
    ids = torch.cat(seqs).to(dev)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).to(dev)
    hidden = model(ids, pos, cache)
    logits = model.logits(hidden[torch.tensor(cu[1:], device=dev) - 1]).float()  # [B, V]
    cache.cu = None
    cache.lens = torch.tensor([len(s) for s in seqs], device=dev)
    outs: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[torch.Tensor]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    active = torch.arange(B, device=dev)
    for _ in range(max_tokens):
        if temperature > 0:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)  # [B']
        else:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(-1)
        tok_lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        done = torch.zeros_like(tok, dtype=torch.bool)
        for j, (b, t) in enumerate(zip(active.tolist(), tok.tolist())):
            outs[b].append(t)
            lps[b].append(tok_lp[j])
            if eos_id is not None and t == eos_id:
                reasons[b], done[j] = "stop", True
        if bool(done.all()) or len(outs[active[0].item()]) >= max_tokens:
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(-1)
            active, tok = active[keep], tok[keep]
            cache.keep(keep)
        hidden = model(tok, cache.lens.clone(), cache)
        cache.lens += 1
        logits = model.logits(hidden).float()
    return [(torch.tensor(o, dtype=torch.long), torch.stack(lp).float().cpu() if lp else torch.zeros(0), r)
            for o, lp, r in zip(outs, lps, reasons)]


def rollout(model: CausalLM, tokenizer, items: Sequence[TaskPrompt], n: int, max_tokens: int,
            version: int = 0, temperature: float = 1.0, seed: int = 0, first_id: int = 0
            ) -> tuple[list[Sample], dict[int, TaskPrompt], dict[int, int]]:
    """n samples per prompt item -> (samples, sample_id -> item, group_id -> n): exactly what
    ``TrainerWorker.begin_iteration`` / ``receive`` take. Group g holds samples g*n .. g*n+n-1
    (offset by ``first_id``)."""
    prompts, groups, ids, gids = {}, {}, [], []
    for g, item in enumerate(items):
        p = tokenizer.encode_prompt(item.prompt, item.messages)
        groups[first_id // max(n, 1) + g] = n
        for _ in range(n):
            sid = first_id + len(ids)
            prompts[sid] = item
            ids.append(p)
            gids.append(first_id // max(n, 1) + g)
    outs = generate(model, ids, max_tokens, tokenizer.eos_id, temperature, seed)
    samples = [Sample(sample_id=first_id + i, prompt_ids=torch.tensor(p), output_ids=o, logprobs=lp,
                      weight_version=version, finish_reason=r, group_id=gids[i])
               for i, (p, (o, lp, r)) in enumerate(zip(ids, outs))]
    return samples, prompts, groups


def mean_reward(task, tokenizer, samples: Sequence[Sample], prompts: dict[int, TaskPrompt]) -> float:
    scores = [as_score(task.score(prompts[s.sample_id], tokenizer.decode(s.output_ids))) for s in samples]
    return sum(scores) / max(len(scores), 1)
