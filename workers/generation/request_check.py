"""Per-request validation shared by every engine backend (native, vLLM): one set of rules
and one message per problem, so a request is refused the same way whichever engine serves it."""
from __future__ import annotations

import math
from typing import Container

import torch

from workers.types import Request


def refusal(req: Request, vocab_size: int, max_len: int, live: Container[int]) -> str | None:
    """Why ``req`` cannot be served (None when it can): ``max_len`` is the engine's context
    (prompt + output tokens), ``live`` the sample ids already queued or running."""
    p = req.prompt_ids
    if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype.is_floating_point or p.is_complex():
        return "prompt_ids must be a 1-D integer tensor"
    if p.numel() == 0:
        return "empty prompt"
    if p.numel() >= max_len:
        return (f"prompt of {p.numel()} tokens does not fit the context: max_model_len "
                f"{max_len} leaves no room for an output token")
    lo, hi = int(p.min()), int(p.max())
    if lo < 0 or hi >= vocab_size:
        return f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})"
    if not _is_int(req.max_tokens) or req.max_tokens < 1:
        return f"max_tokens must be an int >= 1, got {req.max_tokens!r}"
    if not _is_int(req.min_tokens) or not 0 <= req.min_tokens <= req.max_tokens:
        return f"min_tokens must be in [0, max_tokens={req.max_tokens}], got {req.min_tokens!r}"
    s = req.sampling
    # top_k -1 is off, as 0 (vLLM accepts both; -1 was its default for years)
    if not (_is_real(s.temperature) and s.temperature >= 0 and _is_real(s.top_p) and 0 < s.top_p <= 1
            and _is_int(s.top_k) and s.top_k >= -1):
        return (f"bad sampling params {s} (need a finite temperature >= 0, 0 < top_p <= 1 and an "
                "int top_k >= -1)")
    if not (s.seed is None or (_is_int(s.seed) and 0 <= s.seed < 1 << 63)):
        return f"sampling seed must be None or an int in [0, 2**63), got {s.seed!r}"
    if not (_is_real(req.est_len) and req.est_len >= 0):
        return f"est_len must be a finite number >= 0, got {req.est_len!r}"
    if req.sample_id in live:
        return f"sample_id {req.sample_id} is already queued or running"
    return None


def check_eos_ids(eos_ids: tuple[int, ...], vocab_size: int) -> None:
    """Raise ValueError (``engine.eos_ids``) when an EOS id is outside the vocabulary: the
    sampler masks EOS columns of the logits below ``min_tokens``, so such an id would fail
    the first step of every request in flight instead of the engine's construction."""
    bad = [e for e in eos_ids if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"engine.eos_ids: {bad} outside the model's vocabulary [0, {vocab_size}) "
                         f"(EOS ids {tuple(eos_ids)})")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
