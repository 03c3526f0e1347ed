"""One-line notices, said at start, about a valid config that does not do what a verl user
would expect of it (the run goes on; each says which key changes it)."""
from __future__ import annotations

from controller.modes import MODES


def config_notes(cfg) -> list[str]:
    """The notices that apply to ``cfg``."""
    return [note for note in (whitening_note(cfg), off_policy_note(cfg) or async_note(cfg), shard_note(cfg)) if note]


def whitening_note(cfg) -> str | None:
    """The one-line notice for whitened advantages (verl's default for PPO and REINFORCE++), the
    group filter or the importance weights' batch normalisation in a mode that streams samples
    into the trainer: training then waits for each iteration's last sample."""
    t = cfg.trainer
    if MODES[cfg.pipeline.mode].release == "all":
        return None
    if t.whiten:
        return (f"pipeline.mode {cfg.pipeline.mode} with {t.algorithm}: trainer.whiten_advantages (on, "
                "as verl) needs every sample's advantage, so the trainer's forward/backward run at the end of each "
                "iteration, not while samples stream in; set trainer.whiten_advantages: false to train on samples "
                "as they arrive")
    if t.filter_groups:
        return (f"pipeline.mode {cfg.pipeline.mode} with trainer.filter_groups: the filter picks the groups to train "
                "from all of the iteration's, so the trainer's forward/backward run at the end of each iteration, "
                "not while samples stream in")
    if t.algorithm == "gpg":
        return (f"pipeline.mode {cfg.pipeline.mode} with trainer.algorithm gpg: its advantages are scaled by the "
                "iteration's samples over those with a nonzero reward, so the trainer's forward/backward run at the "
                "end of each iteration, not while samples stream in")
    if getattr(t, "custom_advantage", False):
        return (f"pipeline.mode {cfg.pipeline.mode} with trainer.algorithm {t.algorithm}: a verl estimator sees the "
                "iteration's samples at once, so the trainer's forward/backward run at the end of each iteration, not "
                "while samples stream in")
    if t.rollout_is_batch_normalize:
        return (f"pipeline.mode {cfg.pipeline.mode} with trainer.rollout_is_batch_normalize: the importance weights "
                "are divided by their mean over all of the iteration's samples (verl's batch), so the trainer's "
                "forward/backward run at the end of each iteration, not while samples stream in")
    return None


def off_policy_note(cfg) -> str | None:
    """The one-line notice for an async mode whose PPO old log-probs are the trainer's (top-k /
    top-p sampling makes them so): the ratio is then 1 on the one-step-stale samples."""
    t = cfg.trainer
    if MODES[cfg.pipeline.mode].lag > 0 and t.recomputes_old_logprobs and t.is_level is None:
        return (f"pipeline.mode {cfg.pipeline.mode} trains samples of the previous weights, and the PPO old "
                "log-probs are the trainer's own (trainer.recompute_old_logprobs, on with train.top_k / top_p): "
                "the ratio starts at 1, so nothing weights for the staleness (as verl's one-step off-policy); "
                "trainer.rollout_is: token (or sequence; verl's rollout_correction, trainer.tis_cap e.g. 2 is "
                "its token form) weights each token by the trainer/sampler probability ratio")
    return None


def async_note(cfg) -> str | None:
    """The one-line notice for an async mode (the default, ``async_stream``): each iteration
    trains on samples of the previous weights, where verl's loop is synchronous."""
    mode = MODES[cfg.pipeline.mode]
    if mode.lag == 0:
        return None
    return (f"pipeline.mode {cfg.pipeline.mode} (StreamRL-Async) trains each iteration on samples of the previous "
            "weights: one step off-policy; verl's synchronous loop is pipeline.mode: batch (stream overlaps "
            "training with generation on-policy)")


def shard_note(cfg) -> str | None:
    """The one-line notice for ``trainer.shard_optimizer`` with one trainer rank: nothing to shard."""
    if cfg.trainer.shard_optimizer and len(cfg.placement.trainer) == 1:
        return ("trainer.shard_optimizer shards the AdamW state over the data-parallel trainer ranks, and "
                "placement.trainer has one: it keeps all of it (list more ranks there to share it)")
    return None
