"""Validation shared by every engine backend (native, vLLM): one set of rules and one message
per problem, so a request (``refusal``) or a weight update (``check_weights``) is refused the
same way whichever engine serves it."""
from __future__ import annotations

import math
import operator
from typing import Container, Mapping

import torch

from workers.types import SERVED_TEMPERATURES, Request, SamplingParams, temperature_served
# prompt token ids: integer dtypes (bool is not a token id)
_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def sample_id_problem(sid) -> str | None:
    """Why ``sid`` cannot name a request (an engine keys its requests by it), or None: an int,
    not a bool (``True`` and ``1`` are one key; a str, float or bool id was served until
    session 60 although the message said int)."""
    return None if is_int(sid) else f"sample_id must be an int, got {type(sid).__name__} {sid!r}"


def refusal(req: Request, vocab_size: int, max_len: int, live: Container[int]) -> str | None:
    """Why ``req`` cannot be served (None when it can): ``max_len`` is the engine's context
    (prompt + output tokens), ``live`` the sample ids already queued or running."""
    if (why := sample_id_problem(req.sample_id)) is not None:
        return why
    if not is_int(req.group_id) or req.group_id < -1:
        return f"group_id must be an int >= 0 (-1: no group), got {req.group_id!r}"
    p = req.prompt_ids
    if not isinstance(p, torch.Tensor):
        return f"prompt_ids must be a 1-D integer tensor, got {type(p).__name__}"
    if p.dim() != 1 or p.dtype not in _ID_DTYPES:
        return f"prompt_ids must be a 1-D integer tensor, got shape {tuple(p.shape)} {p.dtype}"
    if p.device.type == "meta":
        return "prompt_ids is on the meta device (no data)"
    if p.numel() == 0:
        return "empty prompt"
    if p.numel() >= max_len:
        return (f"prompt of {p.numel()} tokens does not fit the context: max_model_len "
                f"{max_len} leaves no room for an output token")
    lo, hi = int(p.min()), int(p.max())
    if lo < 0 or hi >= vocab_size:
        return f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})"
    if not is_int(req.max_tokens) or req.max_tokens < 1:
        return f"max_tokens must be an int >= 1, got {req.max_tokens!r}"
    if not is_int(req.min_tokens) or not 0 <= req.min_tokens <= req.max_tokens:
        return f"min_tokens must be in [0, max_tokens={req.max_tokens}], got {req.min_tokens!r}"
    s = req.sampling
    if not isinstance(s, SamplingParams):
        return f"sampling must be a SamplingParams, got {type(s).__name__} {s!r}"
    if not (is_real(s.temperature) and s.temperature >= 0):
        return f"sampling temperature must be a finite number >= 0, got {s.temperature!r}"
    if not (is_real(s.top_p) and 0 < s.top_p <= 1):
        return f"sampling top_p must be in (0, 1], got {s.top_p!r}"
    if not (is_int(s.top_k) and s.top_k >= -1):  # -1 is off, as 0 (vLLM accepts both)
        return f"sampling top_k must be an int >= -1 (0 or -1: off), got {s.top_k!r}"
    if not temperature_served(s.temperature):
        return f"temperature {s.temperature} is outside the served range: {SERVED_TEMPERATURES} (vLLM's range)"
    if not (s.seed is None or (is_int(s.seed) and 0 <= s.seed < 1 << 63)):
        return f"sampling seed must be None or an int in [0, 2**63), got {s.seed!r}"
    if not (is_real(req.est_len) and req.est_len >= 0):
        return f"est_len must be a finite number >= 0, got {req.est_len!r}"
    if req.sample_id in live:
        return f"sample_id {req.sample_id} is already queued or running"
    return None


def check_requests(requests) -> list[Request]:
    """``add``'s argument, an iterable of ``Request``s, as a list (a generator is read once: it
    was consumed by this check and nothing was queued). Anything else has no sample id to
    answer with: TypeError naming the first one, before any is queued."""
    if isinstance(requests, (Request, str, bytes)) or not hasattr(requests, "__iter__"):
        raise TypeError(f"add: expected a list of Request, got {type(requests).__name__}")
    requests = list(requests)
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"add: requests[{i}] is a {type(r).__name__}, not a Request")
    return requests


def check_weights(named_tensors, shapes: Mapping[str, tuple[int, ...]], version,
                  dtype: torch.dtype | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """Check a weight update before anything is written; -> (the version as an int, the
    tensors to write). ``named_tensors``: (name, tensor) pairs (``named_parameters()``) or a
    mapping name -> tensor (a ``state_dict``), read once. Raises ValueError naming the first
    problem: an item that is not a (name, tensor) pair, a version that is not an int >= 0, an
    unknown name, a non-tensor or wrong shape, a meta tensor (no data), a non-floating dtype
    (int, bool, complex: a mis-wired sender; a cast would silently change the values) or a
    tensor with NaN/inf (it would make every sample's log-probs NaN).

    ``dtype``: the dtype the engine keeps its weights in. Every tensor is cast to it here,
    before the caller writes anything, so a cast that fails (out of memory) fails before the
    first write, and the NaN/inf check sees the values as they will be stored (a float64
    1e300 is finite, its float32 rounding is not). A tensor already in ``dtype`` is not
    copied. The finiteness check reads each tensor once (a float64 sum per tensor)."""
    items = _weight_pairs(named_tensors)
    if isinstance(version, bool):
        raise ValueError(f"load_weights: version must be an int >= 0, got {version!r}")
    try:
        v = operator.index(version)
    except TypeError:
        raise ValueError(f"load_weights: version must be an int >= 0, got {version!r}") from None
    if v < 0:
        raise ValueError(f"load_weights: version must be an int >= 0, got {version!r}")
    seen = set()
    for name, t in items:
        if name not in shapes:
            raise ValueError(f"load_weights: unknown tensor {name!r} (not a parameter of the model)")
        if name in seen:  # the native engine kept the last, vLLM the first or failed midway (review, s54)
            raise ValueError(f"load_weights: tensor {name!r} is given twice; give each name once")
        seen.add(name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shapes[name]):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"load_weights: tensor {name!r} has shape {got}, "
                             f"expected {tuple(shapes[name])}")
        if t.device.type == "meta":
            raise ValueError(f"load_weights: tensor {name!r} is on the meta device (no data)")
        if not t.dtype.is_floating_point:
            raise ValueError(f"load_weights: tensor {name!r} has dtype {t.dtype}; weights must be "
                             "floating point")
    staged = [(n, t.detach() if dtype is None else t.detach().to(dtype)) for n, t in items]
    sums = [t.sum(dtype=torch.float64) for _, t in staged]  # NaN/inf propagate
    for (name, t), (_, original), s in zip(staged, items, sums):
        if not math.isfinite(s):
            why = "" if t.dtype == original.dtype else f" once rounded to {dtype}"
            raise ValueError(f"load_weights: tensor {name!r} has NaN or infinite values{why}")
    return v, staged


TIED = ("model.embed_tokens.weight", "lm_head.weight")


def check_tied(staged: list[tuple[str, torch.Tensor]], tied: bool) -> None:
    """A model with tied embeddings holds one matrix under both names: given both, they must be
    equal (the native engine wrote the later, vLLM loads the embedding's; review, s54)."""
    if not tied:
        return
    pair = dict(staged)
    if all(n in pair for n in TIED) and not torch.equal(pair[TIED[0]], pair[TIED[1]]):
        raise ValueError(f"load_weights: {TIED[0]!r} and {TIED[1]!r} are one tied matrix in this model "
                         "and were given different values; give one of them")


def _weight_pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, Mapping):
        return list(named_tensors.items())
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not hasattr(named_tensors, "__iter__"):
        raise ValueError(f"load_weights: expected (name, tensor) pairs or a name -> tensor mapping, "
                         f"got {type(named_tensors).__name__}")
    items = list(named_tensors)
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"load_weights: item {i} is {_short(item)}, not a (name, tensor) pair")
    return [tuple(item) for item in items]


def _short(x) -> str:
    text = repr(x) if not isinstance(x, torch.Tensor) else f"a tensor of shape {tuple(x.shape)}"
    return text if len(text) <= 60 else f"a {type(x).__name__}"


def check_batch_cap(n) -> None:
    """``set_max_batch_size``'s argument: an int >= 1 (a bool is not a count)."""
    if not is_int(n) or n < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {n!r}")


def check_eos_ids(eos_ids: tuple[int, ...], vocab_size: int) -> None:
    """Raise ValueError (``engine.eos_ids``) when an EOS id is outside the vocabulary: the
    sampler masks EOS columns of the logits below ``min_tokens``, so such an id would fail
    the first step of every request in flight instead of the engine's construction."""
    bad = [e for e in eos_ids if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"engine.eos_ids: {bad} outside the model's vocabulary [0, {vocab_size}) "
                         f"(EOS ids {tuple(eos_ids)})")


def is_int(x) -> bool:
    """An int that is not a bool (True is an int to Python, not a count or an id)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A finite int or float (an int too large for a float is not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
