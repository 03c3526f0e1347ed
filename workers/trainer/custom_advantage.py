"""A user's advantage estimator, written for verl: ``trainer.algorithm: "path/to/file.py:fn"``
(or ``"package.module:fn"``), a function registered in verl with ``register_adv_est``.

verl calls an estimator other than its GAE and GRPO as
``fn(token_level_rewards=, response_mask=, config=, index=)`` -> ``(advantages, returns)``,
over the whole training batch after its filters (``compute_advantage`` in verl's ray_trainer).
Here it is called the same way at ``step()``, once over the iteration's samples of this trainer
rank (after ``trainer.filter_groups``), with:

* ``token_level_rewards`` [B, T] float32: the shaped score (plus the overlong penalty) at each
  sample's last token, minus beta x KL(old || ref) on every token with ``kl_mode: reward``;
  right-padded with 0 to the longest response;
* ``response_mask`` [B, T] int64: 1 on response tokens (0 on padding and on the tokens
  ``rollout_rs`` rejects, as verl's mask after rejection);
* ``index``: a numpy object array of each sample's group id as a string (verl's ``uid``:
  the samples of one prompt share it);
* ``config``: ``AlgoConfig``, verl's ``algorithm`` fields this run has (``gamma``, ``lam``,
  ``norm_adv_by_std_in_grpo``, ``use_kl_in_reward``, ``adv_estimator``), readable as attributes,
  ``config["gamma"]`` or ``config.get("gamma")`` as verl's config is.

It returns ``(advantages, returns)`` or the advantages alone, [B, T]; each sample trains with
the advantages on its own tokens. A wrong shape, a non-finite advantage on a response token, or
the function raising stops the step with an error naming ``trainer.algorithm``. Training therefore waits for ``step()`` (as whitening's).
With several trainer ranks each calls it on its share (whole groups), where verl calls it once
over the batch: a batch-wide statistic (a whitening) is then per rank. The function is loaded
and its parameters checked when the config loads.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from workers.atomic import file_digest
from workers.tasks.plugins import is_plugin, load_plugin

if TYPE_CHECKING:
    from workers.trainer.buffer import Prepared
    from workers.trainer.config import TrainerConfig
    from workers.trainer.worker import TrainerWorker

KEY = "trainer.algorithm"
PASSED = ("token_level_rewards", "response_mask", "config", "index")  # what verl passes every such estimator


@dataclass(frozen=True)
class AlgoConfig:
    """verl's ``algorithm`` config, the fields this run sets (an estimator reads them as attributes
    or with ``config.get``)."""

    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        if not hasattr(self, key):
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: str) -> bool:
        return hasattr(self, key)


def is_custom(algorithm: str) -> bool:
    """``trainer.algorithm`` names user code (``module:fn``), not one of ours."""
    return is_plugin(algorithm)


def load_estimator(spec: str) -> Callable:
    """The function ``spec`` names, checked to take verl's keywords (``PASSED``): a ValueError
    naming ``trainer.algorithm`` otherwise."""
    fn = load_plugin(spec, KEY)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return fn
    try:
        sig.bind(**{name: None for name in PASSED})
    except TypeError as e:
        raise ValueError(f"{KEY}: {spec!r} must take verl's estimator keywords {', '.join(PASSED)} (or **kwargs), "
                         f"as verl's compute_advantage calls it: {e}") from None
    return fn


def _plugin_file(algorithm: str) -> tuple[Path, str] | None:
    """A file plugin's (resolved path, function name); None for our algorithms and module plugins."""
    module, _, attr = algorithm.rpartition(":")
    return (Path(module).expanduser().resolve(), attr) if is_custom(algorithm) and module.endswith(".py") else None


def canonical(algorithm: str) -> str:
    """``algorithm`` as a checkpoint records it: a file plugin's spec with its path resolved
    (``./est.py:fn`` and ``/abs/est.py:fn`` are the same estimator)."""
    f = _plugin_file(algorithm)
    return algorithm if f is None else f"{f[0]}:{f[1]}"


def identity(algorithm: str) -> tuple[str, str | None]:
    """(``canonical(algorithm)``, a SHA-1 of a file plugin's contents, or None): a resume says
    when the file changed since the save."""
    f = _plugin_file(algorithm)
    digest = file_digest(f[0], "sha1") if f is not None and f[0].is_file() else None
    return canonical(algorithm), digest


def algo_config(cfg: "TrainerConfig") -> AlgoConfig:
    return AlgoConfig(adv_estimator=cfg.algorithm, gamma=cfg.gamma, lam=cfg.gae_lambda,
                      norm_adv_by_std_in_grpo=cfg.grpo_std_normalize, use_kl_in_reward=cfg.kl_in_reward)


def batch_inputs(items: list["Prepared"]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(token_level_rewards [B, T], response_mask [B, T] int64, index [B]) of ``items``."""
    width = max(p.num_tokens for p in items)
    rewards = torch.zeros(len(items), width, dtype=torch.float32)
    mask = torch.zeros(len(items), width, dtype=torch.int64)
    for i, p in enumerate(items):
        n = p.num_tokens
        rewards[i, :n] = p.token_rewards
        mask[i, :n] = 1 if p.keep is None else p.keep.long()
    index = np.array([str(p.group_id) for p in items], dtype=object)
    return rewards, mask, index


def custom_pass(w: "TrainerWorker") -> None:
    """Call the run's estimator over this rank's samples of the step and set their ``adv``."""
    items = list(w.buffer.ready)
    if not items:
        return
    assert not w._trained_any, "advantages after training started"
    rewards, mask, index = batch_inputs(items)
    name = w.cfg.algorithm
    try:
        out = w.advantage_fn(token_level_rewards=rewards, response_mask=mask, config=algo_config(w.cfg), index=index)
    except Exception as e:
        raise RuntimeError(f"{KEY}: {name!r} raised in iteration {w.iteration}: {type(e).__name__}: {e}") from e
    adv = out[0] if isinstance(out, (tuple, list)) else out
    if not torch.is_tensor(adv) or tuple(adv.shape) != tuple(rewards.shape):
        got = f"shape {tuple(adv.shape)}" if torch.is_tensor(adv) else f"a {type(adv).__name__}"
        raise ValueError(f"{KEY}: {name!r} returned advantages of {got} in iteration {w.iteration}, expected a "
                         f"tensor of shape {tuple(rewards.shape)} (the iteration's samples x the longest response)")
    adv = adv.detach().float().cpu()
    bad = ~torch.isfinite(adv) & mask.bool()  # [B, T]: what would train
    if bad.any():
        groups = sorted({items[i].group_id for i in bad.any(1).nonzero().flatten().tolist()})
        raise ValueError(f"{KEY}: {name!r} returned non-finite advantages in iteration {w.iteration} on "
                         f"{int(bad.sum())} response tokens, groups {groups[:5]}{' ...' if len(groups) > 5 else ''} "
                         "(a division by a group's zero std?)")
    # 0 where the mask leaves a token out (an observation token, one rollout_rs rejected): a NaN
    # there stayed out of the loss but not of its gradient (where()'s zero x NaN), and every
    # update was skipped (review, s53)
    adv = torch.where(mask.bool(), adv, torch.zeros_like(adv))
    for i, p in enumerate(items):
        p.adv = adv[i, :p.num_tokens].clone()
