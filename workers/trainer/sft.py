"""SFT warm-start: cross-entropy on a task's demonstrations (``TaskPrompt.answer`` as the
completion, ended by EOS), so a tiny model starts RL from non-zero reward."""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from workers.model import CausalLM
from workers.tasks.scoring import as_score
from workers.tokenizer import Tokenizer
from workers.trainer.packing import pack, response_logits
from workers.types import Task, TaskPrompt

log = logging.getLogger("streamrl.sft")


@dataclass
class SFTResult:
    losses: list[float] = field(default_factory=list)  # per step, mean token cross-entropy
    eval_reward: float | None = None  # greedy mean reward on the test split, if evaluated


@runtime_checkable
class HasDemonstrations(Protocol):
    """A task that supplies its own SFT demonstrations (e.g. a deliberately noisy teacher)."""

    def demonstrations(self, split: str) -> list[tuple[TaskPrompt, str]]: ...


def demonstrations(tokenizer: Tokenizer, task: Task, split: str = "train") -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + EOS) per item of the split: the task's own
    ``demonstrations`` when it has them, else ``(item, item.answer)``."""
    own = isinstance(task, HasDemonstrations)  # chosen by the task (a multi-turn task's first turn)
    pairs = task.demonstrations(split) if own else [(item, item.answer) for item in task.prompts(split)]
    if not own:
        _say_if_unrewarded(task, pairs[:16])
    return [(tokenizer.encode_prompt(item.prompt, item.messages), tokenizer.encode(text) + [tokenizer.eos_id])
            for item, text in pairs]


def _say_if_unrewarded(task: Task, pairs: list[tuple[TaskPrompt, str]]) -> None:
    """A warm start is for a policy that starts RL with some reward: answers as demonstrations
    that the task's own score gives nothing (a bare "72" under the math verifier, which wants \\boxed{72}; empty
    answers) teach a format worth 0. Said, not refused (the task may score another way later)."""
    try:
        scores = [as_score(task.score(item, text)) for item, text in pairs]
    except Exception:  # noqa: BLE001 - a score that cannot run here is the reward pool's to say
        return
    if scores and max(scores) <= 0:
        log.warning("the SFT demonstrations score %s under the task's own score (first %d: %r...): the warm start "
                    "teaches answers worth nothing; give them in the format the verifier rewards (the task's "
                    "demonstrations(), or answers as it expects them)", max(scores), len(scores), pairs[0][1][:40])


def sft_warmstart(model: CausalLM, tokenizer: Tokenizer, task: Task, steps: int, batch_size: int = 32,
                  lr: float = 1e-3, warmup: int = 20, seed: int = 0, split: str = "train", grad_clip: float = 1.0,
                  eval_items: int = 0, eval_max_tokens: int = 128, log_every: int = 0) -> SFTResult:
    """Train ``model`` in place for ``steps`` AdamW steps (cosine decay to 10 %) on random
    batches of demonstrations; loss only on completion tokens. ``eval_items > 0``: greedy
    reward on that many test items afterwards."""
    if steps < 0 or batch_size < 1:
        raise ValueError(f"sft_warmstart: steps must be >= 0 and batch_size >= 1 (got {steps}, {batch_size})")
    data = demonstrations(tokenizer, task, split)
    if not data:
        raise ValueError(f"sft_warmstart: task has no {split!r} items")
    dev = next(model.parameters()).device
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup)) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps))))))
    result = SFTResult()
    model.train()
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        packed = pack([torch.tensor(p) for p, _ in batch], [torch.tensor(c) for _, c in batch], dev)
        logits = response_logits(model, packed)  # [N, V]
        loss = torch.nn.functional.cross_entropy(logits, packed.resp_ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        result.losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            log.info("sft step %d/%d loss %.4f", step + 1, steps, result.losses[-1])
    if eval_items > 0:
        result.eval_reward = evaluate(model, tokenizer, task, eval_items, eval_max_tokens)
    return result


def evaluate(model: CausalLM, tokenizer: Tokenizer, task: Task, items: int, max_tokens: int = 128,
             temperature: float = 0.0, seed: int = 0, split: str = "test") -> float:
    """Mean reward of one completion per item of ``split`` (greedy by default)."""
    from workers.trainer.rollout import mean_reward, rollout

    was_training = model.training
    model.eval()
    samples, prompts, _ = rollout(model, tokenizer, list(task.prompts(split))[:items], 1, max_tokens,
                                  temperature=temperature, seed=seed)
    model.train(was_training)
    return mean_reward(task, tokenizer, samples, prompts)
