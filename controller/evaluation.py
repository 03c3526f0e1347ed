"""Generation outside the training stream, whose outputs come back to the controller: the
periodic and REPL evaluations on the test split, and the policy's output lengths that
bootstrap a length ranker. Both run on the SGS's instances: with the newest weights (staged
ones loaded first) when no round is in flight, else with the weights each holds (async modes
evaluate while the next round generates); an evaluation names the versions it ran with."""
from __future__ import annotations

import functools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from controller.rpc import Completions
from controller.val_metrics import PromptSamples, validation_metrics
from workers.tasks.registry import make_task
from workers.tasks.reward_pool import RewardPool, Scored
from workers.trainer.step_math import failure_kind
from workers.types import Request

log = logging.getLogger("streamrl.controller")


@dataclass
class EvalResult:
    """One evaluation (``evaluate``)."""

    scores: dict[str, float]  # eval/<task>, eval/mean, eval/best@k, eval/unscored, eval/<task>/<var>/<stat>
    prompts: int  # test prompts evaluated
    requested: int  # test prompts asked for (0: all)
    split: int  # test prompts in the split
    samples: int  # generations per prompt (train.eval_samples)
    started: float  # epoch seconds
    seconds: float
    weight_versions: tuple[int, ...] = ()  # the weights the instances generated with (one, unless mixed)
    # each generation ({"input", "output", "gts", "score", "task", "prompt"}), kept when the run logs
    # them (logging.validation_data_dir, logging.log_val_generations; Metrics.log_eval)
    generations: list[dict] = field(default_factory=list)


def side_generate(program, reqs: list[Request], stage: str = "eval", step: int | None = None,
                  errors: dict[int, str] | None = None, turns: dict[int, int] | None = None
                  ) -> tuple[dict[int, list[int]], tuple[int, ...]]:
    """Generate ``reqs`` on ``program``'s instances (spread evenly) outside the training
    stream -> (sample id -> output ids, the weight versions used); ``stage`` names the
    instances' spans ("eval", "ranker"), ``step`` their iteration (the one the evaluation is
    logged at; None: the weight version each holds). With no round in flight the
    instances load their staged weights first (after a push, after ``--resume``). An instance
    lost meanwhile leaves the SGS and its share goes to the others, as a round's does; any
    other failure, or no instance left, fails the evaluation, and the instances still on it
    are told to stop (``GenerationInstance.cancel``): the REPL's next command does not wait
    for generation nobody takes. A sample that failed (its multi-turn environment raised) goes
    to ``errors`` (sample id -> why), or with none given fails the call. ``turns``: filled with
    each sample's assistant turns (multi-turn)."""
    from controller.sgs import NoInstancesLeft

    sgs = program.world.sgs
    newest = program.in_flight is None
    if program.in_flight is not None:  # a round that already failed says why, not this evaluation
        program.in_flight.raise_if_failed()
    waiting = Completions()
    running: dict[str, object] = {}  # token -> handle of each call not ended yet
    name = uuid.uuid4().hex[:12]

    def spread(batch: list[Request]) -> None:
        handles = sgs.handles
        if not handles:
            raise NoInstancesLeft("evaluation: every generation instance is gone ("
                                  + ", ".join(f"rank {r}: {why}" for r, why in sgs.removed) + ")")
        for i, h in enumerate(handles):
            if chunk := batch[i::len(handles)]:
                token = f"{name}-{waiting.added}"
                running[token] = h
                waiting.add(h.call("evaluate", chunk, newest, token, stage, step), (chunk, token))

    outputs: dict[int, list[int]] = {}
    versions: set[int] = set()
    try:
        spread(reqs)
        while waiting.pending:
            (chunk, token), _call, out, err = waiting.next()
            del running[token]
            if err is None:
                if out.errors:
                    if errors is None:
                        raise RuntimeError(out.errors[0][1])
                    errors.update(out.errors)
                outputs.update(out.outputs)
                if turns is not None:
                    turns.update(out.turns)
                versions.add(out.weight_version)
                continue
            sgs.remove_lost(err, "an evaluation")
            spread(chunk)
    except BaseException:
        for token, h in running.items():  # the others stop generating what nobody waits for
            try:
                h.call("cancel", token)  # not waited for: an instance that is gone answers nothing
            except Exception:  # noqa: BLE001 - the error being raised is what the caller hears
                pass
        raise
    finally:
        waiting.cancel()
    return outputs, tuple(sorted(versions))


def measure_lengths(program, prompts: list) -> list[float]:
    """Each prompt's (a ``TaskPrompt``, formatted as training formats it, or a text) mean output
    length (tokens) over ``train.group_size`` samples at the training temperature, bounded as
    training bounds it (``Program.token_bounds``: ``train.min_tokens``, a length trace's forced
    length): what the policy does now (ranker bootstrap), the lengths the online update learns."""
    t = program.cfg.train
    multi_turn = program.cfg.multi_turn.on
    reqs = [Request(-(1 << 40) - j * t.group_size - k, program.prompt_ids(p), *program.token_bounds(p), 0.0,
                    group_id=-1, sampling=program.sampling(t.temperature, t.seed * 7919 + j * t.group_size + k),
                    task=p if multi_turn and not isinstance(p, str) else None)
            for j, p in enumerate(prompts) for k in range(t.group_size)]
    out, _ = side_generate(program, reqs, stage="ranker")
    return [sum(len(out[r.sample_id]) for r in reqs[j * t.group_size:(j + 1) * t.group_size]) / t.group_size
            for j in range(len(prompts))]


def evaluate(program, n: int, step: int | None = None) -> EvalResult:
    """``train.eval_samples`` generations of each of the first ``n`` test prompts (0, or more
    than the split holds: all), at ``train.eval_temperature`` (0: greedy). Scores:
    ``eval/<task>`` and ``eval/mean``, the mean over every sample (verl's mean@k) of its
    ``headline`` (a dict reward's ``acc``, else the score), and with k > 1 ``eval/best@k``, the
    mean over prompts of their best sample's; beside them verl's statistics of each task and
    variable (``val_metrics``: ``eval/<task>/acc/maj@k/mean``, ...). Its span (on the
    controller's row) is recorded where it is logged (``Metrics.log_eval``); ``step``, that
    iteration, labels the instances' spans."""
    t0 = time.time()
    t = program.cfg.train
    split = list(program.task.prompts("test"))
    items = split[:n] if n > 0 else split
    k = t.eval_samples
    multi_turn = program.cfg.multi_turn.on  # the environment is handed the item (single-turn: not sent)
    reqs = [Request(-1 - (j * k + s), program.prompt_ids(it), t.max_tokens, 0, 0.0, group_id=-1,
                    sampling=program.sampling(t.eval_temperature, t.seed * 7919 + j * k + s),
                    task=it if multi_turn else None)
            for j, it in enumerate(items) for s in range(k)]
    failed: dict[int, str] = {}  # samples whose generation failed: unscored, as a failed score
    turns: dict[int, int] = {}
    outputs, versions = side_generate(program, reqs, step=step, errors=failed, turns=turns)
    texts = {sid: program.tok.decode(ids) for sid, ids in outputs.items()}
    per: dict[str, list[float]] = {}
    best: list[float] = []
    samples: list[PromptSamples] = []
    unscored, whys = 0, {}
    pool = eval_rewards(program)
    # every score in flight at once (trainer.reward_workers; one score_batch call where the task
    # has one), but a failed sample's: an empty text in a batch reward's call could fail it whole
    scoring = [(r.sample_id, i // k) for i, r in enumerate(reqs) if r.sample_id not in failed]
    pending = dict(zip([sid for sid, _ in scoring],
                       pool.submit_many([(items[j], texts.get(sid, ""), f"eval prompt {j}") for sid, j in scoring])))
    lg = program.cfg.logging
    keep = bool(lg.validation_data_dir or lg.log_val_generations)
    generations = []
    for j, it in enumerate(items):
        ids = [r.sample_id for r in reqs[j * k:(j + 1) * k]]
        got = [Scored(math.nan, failed[sid], 0.0) if sid in failed else pool.result(pending[sid]) for sid in ids]
        scores = [_score(g, j, whys) for g in got]
        if keep:
            shown = program.tok.decode(reqs[j * k].prompt_ids, skip_special_tokens=True)  # (encoded once, above)
            rows = [{"prompt": j, "task": it.task, "input": shown, "output": texts.get(sid, ""),
                     "gts": it.answer, "score": x if math.isfinite(x) else None} for sid, x in zip(ids, scores)]
            # verl's dump: the reward's extra numbers and texts beside the score
            generations += [{**row, **{n: v for n, v in g.info.items() if n not in row}} for g, row in zip(got, rows)]
        scored = [(x, g.info) for x, g in zip(scores, got) if math.isfinite(x)]
        samples.append(PromptSamples(it.task, [{**info, "reward": x} for x, info in scored]))  # (the score wins)
        ok = [headline(x, info) for x, info in scored]
        unscored += k - len(ok)
        per.setdefault(it.task, []).extend(ok)
        if ok:
            best.append(max(ok))
    acc = {f"eval/{_task_key(name)}": sum(v) / len(v) for name, v in per.items() if v}
    acc.update(validation_metrics(samples, _task_key))
    if len(items) * k > unscored:  # nothing scored: no mean (a 0 would read as 0% accuracy)
        acc["eval/mean"] = sum(sum(v) for v in per.values()) / (len(items) * k - unscored)
    if k > 1 and best:  # (nothing scored: no best@k either)
        acc[f"eval/best@{k}"] = sum(best) / len(best)
    if multi_turn and turns:  # verl's val-aux/num_turns/* (which counts user + assistant turns + 1)
        acc.update({"eval/num_turns/mean": sum(turns.values()) / len(turns),
                    "eval/num_turns/min": float(min(turns.values())), "eval/num_turns/max": float(max(turns.values()))})
    if unscored:
        acc["eval/unscored"] = float(unscored)
        for why, prompts in whys.values():  # one line per kind of failure, not one per prompt
            log.warning("eval: %d samples of %d prompts (first: prompt %d) left out of eval/mean: %s",
                        sum(prompts.values()), len(prompts), next(iter(prompts)), why)
    return EvalResult(acc, len(items), n, len(split), k, t0, time.time() - t0, versions, generations)


def headline(score: float, info: dict) -> float:
    """A sample's headline figure: a dict reward's ``acc`` when it gives one (verl's ``val-core``
    variable: ``math_dapo`` scores +-1 and gives ``acc`` 0 / 1), else its score."""
    acc = info.get("acc")
    return acc if isinstance(acc, float) else score


def _task_key(name: str) -> str:
    """A task's (data_source's) name as its ``eval/`` key; one named as an aggregate (``mean``,
    ``unscored``, ``best@K``) is ``task:<name>``: its score was overwritten by the aggregate's."""
    return f"task:{name}" if name in ("mean", "unscored") or name.startswith("best@") else name


def eval_rewards(program) -> RewardPool:
    """The controller's reward pool for eval, made at the first eval: the trainer's settings
    (``trainer.reward_workers``, ``reward_pool``, ``reward_timeout_s``, ``reward_batch_size``), so a reward that needs
    processes (``signal.alarm``, CPU-bound) scores the same way in eval as in training."""
    if program.eval_pool is None:
        tr, task = program.cfg.trainer, program.cfg.task
        program.eval_pool = RewardPool(program.task, tr.reward_workers, tr.reward_pool, tr.reward_timeout_s,
                                       functools.partial(make_task, task.name, **dict(task.kwargs)),
                                       batch_size=tr.reward_batch_size)
    return program.eval_pool


def _score(scored: Scored, j: int, whys: dict[str, tuple[str, dict[int, int]]]) -> float:
    """The task's score, NaN (left out, counted) when it or the sample's generation failed, as
    for training samples; a failure is kept in ``whys`` (its kind, the trainer's ``failure_kind``:
    its numbers blanked -> (the first why of that kind, prompt index -> samples)), said once per kind."""
    if scored.why:
        _, per = whys.setdefault(failure_kind(scored.why), (scored.why, {}))
        per[j] = per.get(j, 0) + 1
    return scored.score
