"""TrainerWorker: actor + frozen reference (+ critic), fed sample by sample, one optimizer step
per iteration.

    w = TrainerWorker(cfg, model_dir, task)            # rank/world_size/group for data parallel
    w.begin_iteration(it, prompts={sample_id: TaskPrompt}, group_sizes={group_id: n})
    w.receive(samples)        # any number of calls, samples in any order
    result = w.step()         # -> StepResult(version, metrics, num_samples, num_tokens)

``receive`` does the per-sample work at once (reward from the task's verifier on the decoded
completion, in the reward pool beside the forwards: ``workers/tasks/reward_pool.py``; reference
log-probs, critic values) and trains a packed micro-batch (forward +
backward, gradients accumulated as SUMS) whenever samples whose advantages are known fill
``max_tokens_per_microbatch``. ``step`` trains the rest, all-reduces gradient sums and counts
over the data-parallel group, divides by the iteration's total tokens (or sequences), clips,
checks finiteness and steps. Data parallel: each rank receives a disjoint share of the
samples; under the grouped algorithms every sample of a group goes to the same rank.

Where training needs the iteration's last sample (whitening, the group filter, gpg's scale, a
user's verl estimator, the IS batch normalisation: ``TrainerConfig.trains_at_step``), ``receive`` only
prepares samples and every forward + backward runs at ``step()`` (``step_passes.py``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from workers.model import load_pretrained, resolve_device, stop_ids
from workers.tasks.reward_pool import RewardPool
from workers.tokenizer import Tokenizer
from workers.trainer import checkpoint
from workers.trainer.buffer import GroupState, Prepared, SampleBuffer, microbatches
from workers.trainer.config import TrainerConfig
from workers.trainer.critic import ValueModel
from workers.trainer.custom_advantage import load_estimator
from workers.trainer.group_filter import count_passing, same_scores
from workers.trainer.kl_control import KLCoefficient
from workers.trainer.sample_checks import bad_sample_reason, check_caller, check_group_counts, check_new_ids
from workers.trainer import optimizer, remax
from workers.trainer.lora import LoRA, Reference, store_linears, target_names
from workers.trainer.schedule import group_lambdas
from workers.trainer.stat_sums import StatSums
from workers.trainer.step_math import overlong_penalty, prepare_batch, submit_scores, train_terms
from workers.trainer.step_passes import iteration_passes
from workers.trainer.updates import fold_later_passes, gathered_metrics, mini_batch_updates, streamed_updates
from workers.types import Sample, Task, TaskPrompt

log = logging.getLogger("streamrl.trainer")


@dataclass
class StepResult:
    """``version``: the weight version after the step (unchanged when the step was skipped:
    ``metrics["step_skipped"] == 1``)."""

    version: int
    metrics: dict[str, float]
    num_samples: int
    num_tokens: int


def _locked(method):
    """RPC serves calls from a thread pool: generation instances may call ``receive``
    concurrently, so the worker's public methods run one at a time."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class TrainerWorker:
    def __init__(self, cfg: TrainerConfig, model_dir: str, task: Task, rank: int = 0, world_size: int = 1,
                 group=None, device=None, build_task: Callable[[], Task] | None = None):
        """``build_task``: how a ``reward_pool: processes`` process builds the task (a picklable
        callable, e.g. ``functools.partial(make_task, name, **kwargs)``; default: ``task`` pickled)."""
        self.cfg, self.task, self.model_dir = cfg, task, str(model_dir)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.device = resolve_device(device)
        torch.manual_seed(cfg.seed)
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.tokenizer = Tokenizer.load(model_dir, chat_template=False)  # decodes outputs (for the rewards)
        self.score_failures: set[str] = set()  # kinds of reward failure logged so far (once each)
        # the stop ids the controller gives the engines: masked where min_tokens applied
        self.eos_ids = torch.tensor(stop_ids(model_dir, self.tokenizer.eos_id), dtype=torch.long)
        self.actor = load_pretrained(model_dir, self.device, dtype=torch.float32)  # fp32 master weights
        self.actor.train()
        self.actor.model.checkpoint_layers = cfg.activation_checkpointing
        self.critic = ValueModel(self.actor) if cfg.use_critic else None  # a full copy, LoRA or not
        if self.critic is not None:
            self.critic.model.checkpoint_layers = cfg.activation_checkpointing
        self.lora = (LoRA(self.actor, cfg.lora_rank, cfg.lora_alpha, target_names(cfg.lora_target_modules))
                     if cfg.lora_rank else None)
        self.ref = None  # no KL to the reference (kl_coef 0): no reference, no forward of it (as verl)
        if self.lora is not None:  # the base model, i.e. the actor with its adapters off
            if cfg.uses_reference:
                self.ref = Reference(self.actor, self.lora)
            if self.bf16:  # frozen: no fp32 master needed; the autocast forward is the same
                store_linears(self.actor, torch.bfloat16)
        elif cfg.uses_reference:  # the actor's forward at version 0 (KL 0), its linears in bf16 under bf16
            # (whole in bf16 it was another model: KL 3e-5 at init, review session 51); laid out on
            # the CPU first, so the device never holds it whole in fp32
            self.ref = load_pretrained(model_dir, "cpu" if self.bf16 else self.device, dtype=torch.float32).eval()
            self.ref.requires_grad_(False)
            if self.bf16:
                store_linears(self.ref, torch.bfloat16)
                self.ref.to(self.device)
        groups = [{"params": self.policy_parameters(), "lr": cfg.lr}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": cfg.critic_lr})
        self.optimizer = optimizer.build(cfg, groups, world_size, group)
        self.actor_steps = 0  # schedule steps that updated the actor (not trainer.critic_warmup's)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           group_lambdas(cfg, len(groups), lambda: self.actor_steps))
        self._version = 0
        self.iteration, self._stepped = -1, False
        # beta of trainer.kl_mode reward: fixed, or adapted after each step (trainer.kl_target)
        self.kl = KLCoefficient(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        self.advantage_fn = load_estimator(cfg.algorithm) if cfg.custom_advantage else None  # a user's verl estimator
        self._prompts: dict[int, TaskPrompt] = {}
        self._group_sizes: dict[int, int] = {}
        self._seen: set[int] = set()  # sample ids received this iteration (duplicates dropped)
        self._group_seen: dict[int, int] = {}  # group id -> its samples received this iteration
        self._skip_kinds: dict[str, int] = {}  # why samples were skipped this iteration: counts
        self.buffer = SampleBuffer()
        self.stats = StatSums(self.device)
        self.first_divisors = (0.0, 0.0)  # the first pass's loss and fraction divisors (gathered_metrics)
        self._trained_any = False
        self.trained_batches: list[list] = []  # micro-batches kept for ppo_epochs > 1 or mini_batches > 1
        self.rollout_rows: list[dict] | None = None  # [] keeps each scored sample (rollout_dump.py)
        self.filtered_ids: set[int] = set()  # the samples the last step's group filter dropped
        self._lock = threading.RLock()
        self.rewards = RewardPool(task, cfg.reward_workers, cfg.reward_pool, cfg.reward_timeout_s, build_task,
                                  batch_size=cfg.reward_batch_size)

    # ---- public API --------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def autocast(self):
        """bf16 autocast around forwards when mixed precision is on (weights stay fp32)."""
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @_locked
    def begin_iteration(self, iteration: int, prompts: dict[int, TaskPrompt], group_sizes: dict[int, int]) -> None:
        if self._trained_any or self.buffer.pending:
            raise RuntimeError(f"begin_iteration({iteration}): iteration {self.iteration} has "
                               f"{self.buffer.pending} pending samples / accumulated gradients; call step() first")
        bad = {g: n for g, n in group_sizes.items() if n < 1}
        if bad:
            raise ValueError(f"begin_iteration({iteration}): group sizes must be >= 1, got {bad}")
        self.iteration, self._stepped = iteration, False
        self._prompts = dict(prompts)
        self._group_sizes = dict(group_sizes)
        self._seen = set()
        self._group_seen = {}
        self._skip_kinds = {}
        self.buffer.clear()
        self.stats.reset()

    @_locked
    def extend_iteration(self, prompts: dict[int, TaskPrompt], group_sizes: dict[int, int]) -> None:
        """More samples (and groups) for the current iteration: the controller's refill of a batch
        that ``filter_groups`` left short (``trainer.max_gen_batches``)."""
        self._refuse_if_stepped("extend_iteration")
        if self._trained_any:
            raise RuntimeError(f"extend_iteration: iteration {self.iteration} has trained already")
        check_new_ids(f"extend_iteration({self.iteration})", prompts, group_sizes, self._prompts, self._group_sizes)
        self._prompts.update(prompts)
        self._group_sizes.update(group_sizes)

    def passing_groups(self, pending: dict[int, list[tuple[int, object, int]]]) -> int:
        """group id -> its members' (sample id, score in flight: ``score_ahead``'s, output
        length), those of samples not refused: how many groups the filter would keep (before
        ``train_groups``; ``group_filter.count_passing``)."""
        return count_passing(pending, self.rewards.result, self.cfg.filter_metric,
                             lambda n: overlong_penalty(n, self.cfg), self.cfg.grouped)

    def score_ahead(self, samples: Sequence[Sample], prompts: dict[int, TaskPrompt], iteration: int) -> dict:
        """Put the task's score of each of ``samples`` (of ``iteration``, whose prompts are
        ``prompts``) in flight now, without the worker's lock: the trainer rank calls it as samples
        arrive, so rewards run while earlier samples train and generation goes on. Hand the result
        to ``receive(..., scores=)``."""
        # staleness is judged when it trains (the sample's own version here); a sample bad
        # otherwise is refused by receive, unscored
        good = [s for s in samples if bad_sample_reason(s, s.weight_version, self.cfg, self.actor.config) is None]
        return submit_scores(self, good, prompts, iteration)

    @_locked
    def receive(self, samples: Sequence[Sample], scores: dict | None = None) -> None:
        """``scores``: ``score_ahead`` of (some of) these samples; the rest are scored here."""
        if samples:
            self._refuse_if_stepped("receive")
        for s in samples:  # caller bugs raise before any sample of this call is consumed
            check_caller(s, self._prompts, self._group_sizes, self._version, self.cfg, self.iteration)
        if self.cfg.grouped:
            check_group_counts(samples, self._seen, self._group_seen, self._group_sizes, self.iteration)
        accepted = [s for s in samples if self._accept(s)]
        # every score in flight first: the rewards run beside the forwards below
        scores = dict(scores or {})
        scores.update(submit_scores(self, [s for s in accepted if s.sample_id not in scores]))
        baselines = [s for s in accepted if s.baseline]  # remax's greedy samples: no forward, not trained
        accepted = [s for s in accepted if not s.baseline]
        # by prompt + output tokens, so receive-time forwards stay bounded
        for chunk in microbatches(accepted, self.cfg.max_tokens_per_microbatch,
                                  lambda s: s.prompt_ids.numel() + s.output_ids.numel()):
            items = prepare_batch(self, chunk, scores)
            ok = []
            for s, p in zip(chunk, items):
                if isinstance(p, str):  # the task's score failed (said by the scorer when skipped)
                    self._reject(s, p, logged=True)
                else:
                    ok.append(p)
            self._route(ok)
        for s in baselines:  # after the forwards: their scores ran beside them
            remax.take_baseline(self, s, scores[s.sample_id])
        if not self.cfg.trains_at_step:  # whitened advantages, the group filter: known at step()
            self._train_ready(flush=False)

    @_locked
    def step(self) -> StepResult:
        self._flush_incomplete_groups()
        iteration_passes(self)  # the group filter, whitening, gpg's scale, the IS batch normalisation
        self._train_ready(flush=True)
        return self._optimizer_step()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's tensors with Hugging Face names (fp32 masters; tied lm_head omitted), its
        LoRA adapters merged in."""
        for name, t in self.actor.hf_state_dict().items():
            yield name, (self.lora.merged(name, t) if self.lora is not None else t)

    def policy_parameters(self) -> list[torch.nn.Parameter]:
        """What the policy's update trains: every actor parameter, or only its LoRA adapters."""
        return list((self.lora if self.lora is not None else self.actor).parameters())

    @_locked
    def save_checkpoint(self, path: str) -> None:
        """Every data-parallel rank calls this: rank 0 writes, the others return (at once, or after
        sending their share of a sharded optimizer's state to rank 0)."""
        state = optimizer.full_state_dict(self.optimizer, self.rank)
        rng = checkpoint.rng_states(self)
        if self.rank == 0:
            checkpoint.save(self, path, state, rng)

    @_locked
    def load_checkpoint(self, path: str) -> None:
        checkpoint.load(self, path)
        self.buffer.clear()
        self.stats.reset()
        self._trained_any = False
        self.trained_batches = []
        for p in self._params():
            p.grad = None

    # ---- receive-time bookkeeping ----------------------------------------------------------
    def _reject(self, s: Sample, reason: str, logged: bool = False) -> None:
        """Skip a bad sample (counted), or raise with ``on_bad_sample: error``. ``logged``: its
        reason was already logged (a failing reward is logged once per kind, not per sample)."""
        if self.cfg.on_bad_sample == "error":
            raise ValueError(reason)
        kind = reason.split(": ", 1)[-1]
        if not kind.startswith("the task's score"):  # the user's own message keeps its numbers
            kind = re.sub(r"\d+", "N", kind)  # "sample 12: 9 + 60 tokens ..." -> "N + N tokens ..."
        if not logged and kind not in self._skip_kinds:  # once per kind and iteration, then counted
            log.warning("trainer rank %d skips %s (more samples skipped for this reason are counted, not "
                        "listed)", self.rank, reason)
        self._skip_kinds[kind] = self._skip_kinds.get(kind, 0) + 1
        self.stats.add("skipped_samples", 1.0)
        g = self.buffer.groups.get(s.group_id)
        if self.cfg.grouped and s.group_id in self._group_sizes:
            if g is None:
                g = self.buffer.groups[s.group_id] = GroupState(self._group_sizes[s.group_id])
            g.dropped += 1
            self._maybe_complete(s.group_id)

    def _accept(self, s: Sample) -> bool:
        sid = s.sample_id
        if sid in self._seen:
            log.warning("trainer rank %d: sample %d received twice in iteration %d; duplicate dropped",
                        self.rank, sid, self.iteration)
            self.stats.add("duplicates", 1.0)
            return False
        self._seen.add(sid)
        self._group_seen[s.group_id] = self._group_seen.get(s.group_id, 0) + 1
        reason = bad_sample_reason(s, self._version, self.cfg, self.actor.config)
        if reason is not None:
            self._reject(s, reason)
            return False
        return True

    def _route(self, items: list[Prepared]) -> None:
        for p in items:
            self.stats.add_sample(p, self._version)
        if not self.cfg.grouped:
            self.buffer.push_ready(items)
            return
        for p in items:
            g = self.buffer.groups.get(p.group_id)
            if g is None:
                g = self.buffer.groups[p.group_id] = GroupState(self._group_sizes[p.group_id])
            g.members.append(p)
            self._maybe_complete(p.group_id)

    def _maybe_complete(self, group_id: int, force: bool = False) -> None:
        from workers.trainer.step_math import group_advantages

        g = self.buffer.groups.get(group_id)
        if g is None or not (g.complete or force):
            return
        del self.buffer.groups[group_id]
        if g.members and self.cfg.algorithm == "remax" and g.baseline is None:
            remax.drop_unbased(self, group_id, g.members)
        elif g.members:
            self.stats.add("groups", 1.0)
            # nothing to compare, advantage 0 (remax: the members scored as the greedy response)
            if same_scores([m.score for m in g.members] + ([] if g.baseline is None else [g.baseline_score])):
                self.stats.add("uniform_groups", 1.0)
            group_advantages(self.cfg, g.members, g.baseline)
            self.buffer.push_ready(g.members)

    def _flush_incomplete_groups(self) -> None:
        for gid in list(self.buffer.groups):
            g = self.buffer.groups[gid]
            log.warning("trainer rank %d: group %d has %d of %d samples at step(); using those",
                        self.rank, gid, len(g.members) + g.dropped + (g.baseline is not None), g.expected)
            self.stats.add("incomplete_groups", 1.0)
            self._maybe_complete(gid, force=True)

    # ---- training ----------------------------------------------------------------------------
    def _params(self) -> list[torch.nn.Parameter]:
        return [p for grp in self.optimizer.param_groups for p in grp["params"]]

    def _train_ready(self, flush: bool) -> None:
        while True:
            items = self.buffer.pop_microbatch(self.cfg.max_tokens_per_microbatch, flush)
            if not items:
                return
            if self.cfg.mini_batches > 1:  # trained at step(), one update per mini-batch
                self.trained_batches.append(items)
                self._trained_any = True
                continue
            if self.accumulate(items, log_stats=True) is not None:
                self._trained_any = True
                if self.cfg.ppo_epochs > 1:
                    self.trained_batches.append(items)

    def accumulate(self, items: list, log_stats: bool, later: bool = False) -> dict[str, torch.Tensor] | None:
        """Forward + backward of one micro-batch (gradient SUMS accumulate); its counts, or None
        when its loss is not finite (skipped: one host sync per micro-batch, not per token).
        ``log_stats``: add its statistics to the iteration's metrics (first pass); ``later``: add
        its per-token ones to the later passes' (``StatSums.later``)."""
        with self.autocast():
            loss_sum, counts = train_terms(self, items)
        if not bool(torch.isfinite(loss_sum)):
            if log_stats:
                log.warning("trainer rank %d: non-finite loss in a micro-batch of samples %s; skipped",
                            self.rank, [p.sample_id for p in items][:8])
                self.stats.add("skipped_microbatches", 1.0)
            return None
        loss_sum.backward()
        if log_stats:
            self.stats.add_counts(counts)
        elif later:
            self.stats.add_later(counts)
        return counts

    def _optimizer_step(self) -> StepResult:
        params = self._params()
        lr = float(self.scheduler.get_last_lr()[0])
        if self.cfg.mini_batches > 1:  # trains here (first pass: the logged statistics)
            applied, norms = mini_batch_updates(self, params)
        metrics, divisor = gathered_metrics(self)
        if self.cfg.mini_batches == 1:  # gradients accumulated while streaming
            applied, norms = streamed_updates(self, params, divisor)
        fold_later_passes(self, metrics)
        metrics.update(norms or {}, lr=lr)
        if applied:
            self.actor_steps += self.iteration >= self.cfg.critic_only_iterations  # (before: its lambda reads it)
            self.scheduler.step()
            self._version += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics["step_skipped"] = float(applied == 0)
        if self.cfg.critic_warmup:  # 1: only the critic was updated (trainer.critic_warmup)
            metrics["actor_frozen"] = float(self.iteration < self.cfg.critic_only_iterations)
        metrics["updates"] = float(applied)
        result = StepResult(version=self._version, metrics=metrics, num_samples=int(metrics["num_samples"]),
                            num_tokens=int(metrics["num_tokens"]))
        if sum(self._skip_kinds.values()) > len(self._skip_kinds):  # some were counted, not listed
            log.warning("trainer rank %d, iteration %d: skipped %s", self.rank, self.iteration,
                        ", ".join(f"{n} x {kind}" for kind, n in self._skip_kinds.items()))
        self._skip_kinds = {}
        self.buffer.clear()
        self.stats.reset()
        self.trained_batches = []
        self._trained_any = False
        self._stepped = True
        return result

    def _refuse_if_stepped(self, call: str) -> None:
        """A sample for an iteration already stepped was taken, and trained alone at a second
        step (review, s53; the controller's inbox drops such stragglers before they come)."""
        if self._stepped:
            raise RuntimeError(f"{call}: iteration {self.iteration} was stepped; begin_iteration() the next first")
