"""TensorBoard logging of the controller: per-iteration scalars, evaluations, timeline files.

Scalars per iteration: the trainer's metrics (``train/*``: reward_mean, kl, losses, entropy,
...), the batch's lengths (``batch/*``), throughput (samples/s, tokens/s), stage times
(``time/*``), idle (bubble) fraction per device, staleness, weight-sync time, and delta =
generation time - training time (stage balancing). docs/controller.md defines each tag.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter  # at set-up: imported at the first log, it stalled iteration 1

from controller.jsonl_log import append_line, drop_rows_from, load_spans
from controller.timeline import (BATCH_STAGES, CONTROLLER, Span, bubble_fractions, gantt_figure, iteration_windows,
                                 merge_intervals, pyplot, write_chrome_trace)
from controller.trackers import Fanout
from workers.atomic import atomic_file
from workers.generation_dump import markdown, write_rows

# evaluations asked for (not train.eval_every's): their TensorBoard group, per source
ON_DEMAND = {"repl": "eval_repl", "eval_only": "eval_only"}
SPANS = "spans.jsonl"  # every span of every attempt, one JSON object a line, appended per iteration
KEEP_SPANS = 20_000  # an attempt's latest spans held (~2,000 iterations of a few instances)


def stage_busy(spans: list[Span], stage: str) -> float:
    """Busy seconds of ``stage`` on its busiest worker (the stage's critical path)."""
    per: dict[str, list[Span]] = {}
    for s in spans:
        if s.stage == stage:
            per.setdefault(s.worker, []).append(s)
    return max((sum(b - a for a, b in merge_intervals(v)) for v in per.values()), default=0.0)


class Metrics:
    """One run's TensorBoard scalars (``<logdir>/tb``), ``iterations.jsonl`` rows and timeline.

    A resumed run (``--resume``, or a ``torchrun --max-restarts`` restart from the last
    checkpoint) continues in the same folder: when the earlier attempt had logged iterations
    from the first step this one logs, N, on (it crashed after its last checkpoint), those are
    replaced (TensorBoard ``purge_step``; their iterations.jsonl rows are dropped), so no step
    appears twice. The writer is opened at that first write, when N is known. The spans of
    earlier attempts (``spans.jsonl``) stay in the trace, as processes of their own."""

    def __init__(self, logdir: str | Path, timeline_every: int = 5, trackers: list | None = None,
                 validation_data_dir: str = "", log_val_generations: int = 0, timeline_files: bool = True):
        """``trackers``: ``controller.trackers`` (wandb) that get every scalar TensorBoard gets.
        ``validation_data_dir`` / ``log_val_generations``: each evaluation's generations as JSON
        lines there, and its first N as TensorBoard text (``log_eval``). ``timeline_files``
        False: timeline.png / timeline.json are left as they are (``train.eval_only``: the run
        it evaluates keeps its own)."""
        self.timeline_files = timeline_files
        self.logdir = Path(logdir)
        self.validation_data_dir, self.log_val_generations = validation_data_dir, log_val_generations
        self.trackers = Fanout(trackers or [])
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = None
        self._beside = False  # the writer was opened beside the run's steps, replacing none
        self.timeline_every = timeline_every
        earlier = load_spans(self.logdir / SPANS)  # earlier attempts' spans (read for their count)
        # one per start of this folder: config.yaml / config.resume<N>.yaml (run_record, written
        # before any work), so an attempt that stopped before it logged a span still counts
        records = len(list(self.logdir.glob("config.yaml")) + list(self.logdir.glob("config.resume*.yaml")))
        self.attempt = max(max((s.attempt for s in earlier), default=-1) + 1, records - 1)
        # this attempt's latest spans (the figure, the REPL's timeline, the trace written while it
        # runs); every span is in spans.jsonl (all of them held and laid out at each write made a
        # run's memory and its timeline writes grow with it: 2 s a write at 20k iterations, s51)
        self.spans: deque[Span] = deque(maxlen=KEEP_SPANS)
        self._kept = 0  # spans this attempt kept
        self._spans_lock = threading.Lock()
        self._batch_spans: dict[int, list[Span]] = {}  # iteration -> its batch's spans, until logged
        self._prev_drain: list[Span] = []
        self._steps: set[int] = set()  # iterations this attempt logged
        self._tb_once: set[tuple[str, int]] = set()  # (tag group, step) written: one point per step
        self.rewards: list[float] = []
        self.samples = 0
        self.skipped = 0
        self.tokens = 0
        self.seconds = 0.0
        # timeline files are written on a thread of their own, off the pipeline's critical path
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="timeline")
        self._want: tuple[int, int] | None = None  # (upto, spans) of the write wanted next
        self._want_lock, self._write_lock = threading.Lock(), threading.Lock()
        self._written = 0  # spans in the last timeline files written
        self._whole_at = -1  # spans kept when the whole trace was last written
        if timeline_every:
            pyplot()  # imported now (~1-2 s on a loaded machine), not while the pipeline runs

    def _open(self, first_step: int | None):
        """The TensorBoard writer, opened at the first write. ``first_step``: the first step this
        attempt writes (None: it writes beside the run's steps, replacing none: train.eval_only)."""
        if self._writer is None:
            # steps logged again (a restart from an older checkpoint than the last row) are
            # purged; a plain resume (rows end just before first_step) purges nothing, not even
            # the final Gantt figure logged at step first_step - 1
            iters = evals = []  # the rows dropped
            if first_step is not None:
                iters = drop_rows_from(self.logdir / "iterations.jsonl", first_step)
                evals = drop_rows_from(self.logdir / "eval.jsonl", first_step)
            for row in evals:  # their generations (logging.validation_data_dir) go with them
                if isinstance(row.get("generations"), str):
                    Path(row["generations"]).unlink(missing_ok=True)
            again = bool(iters or evals)
            self._writer = SummaryWriter(str(self.logdir / "tb"))
            if again:
                _purge_from(self._writer, first_step)
            self._beside = first_step is None
            self._earlier_evals(first_step if again else None)
        return self._writer

    def _earlier_evals(self, purged_from: int | None) -> None:
        """The evaluations earlier attempts logged (the rows kept in eval.jsonl): their points
        stay in TensorBoard, so their (tag group, step) has one (a REPL ``eval`` run again at
        that step after a resume added a second point). An eval-only row at or after the step
        the writer purged from lost its point: written again (its row stays: no run writes it)."""
        path = self.logdir / "eval.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                row = json.loads(line)
                group, timing = _eval_tags(row["source"], row["prompts"])
                step = int(row["iteration"])
            except (ValueError, KeyError, TypeError):
                continue
            self._tb_once.add((group, step))
            if purged_from is not None and row["source"] == "eval_only" and step >= purged_from:
                scores = {group + k.removeprefix("eval/"): v for k, v in row.items() if k.startswith("eval/")}
                for k, v in {**scores, timing: row.get("seconds", 0.0)}.items():
                    self._writer.add_scalar(k, float(v), step)

    def _keep(self, spans: list[Span]) -> None:
        """This attempt's spans: in memory, and appended to ``spans.jsonl`` at once (so a crash or
        Ctrl-C leaves every span logged so far)."""
        for s in spans:
            s.attempt = self.attempt
        with self._spans_lock:  # (the timeline thread snapshots both)
            self.spans.extend(spans)
            self._kept += len(spans)
        if spans:
            append_line(self.logdir / SPANS, "\n".join(json.dumps(vars(s)) for s in spans))

    def add_spans(self, spans: list[Span]) -> None:
        """Spans drained outside an iteration's logging (the last ones, at the end): kept."""
        self._keep(spans)

    def log_iteration(self, res, spans: list[Span]) -> dict[str, float]:
        """Write one iteration's scalars; returns the derived ones (delta, bubbles, rates).
        ``spans``: every span drained since the last call. In the async modes some of them
        belong to the next iteration (G(i+1) runs during step(i)); they are kept for it."""
        step = res.iteration
        if self._beside:  # opened by an evaluation before this attempt trained (a REPL's): from
            self._writer.close()  # here it replaces the steps an earlier attempt logged from `step`
            self._writer = None
        w = self._open(step)
        self._keep(spans)
        self._steps.add(step)
        for s in spans:
            if s.stage in BATCH_STAGES:
                self._batch_spans.setdefault(s.iteration, []).append(s)
        recent, self._prev_drain = self._prev_drain + spans, spans
        it_spans = self._batch_spans.get(step, [])
        for i in [i for i in self._batch_spans if i <= step]:
            del self._batch_spans[i]
        scalars = {f"train/{k}": float(v) for k, v in res.metrics.items()}
        reward = res.reward_mean
        self.rewards.append(reward)
        # the samples trained (with trainer.filter_groups num_samples counts every one received,
        # the dropped groups too: 288 for 64 trained in the DAPO example)
        trained = float(res.trained)
        self.samples += trained
        self.skipped += res.skipped_samples
        out_tokens = sum(res.gen_lens)  # every output token generated (remax's greedy ones, filtered groups too)
        self.tokens += out_tokens
        self.seconds += res.interval_s
        gen_busy, train_busy = stage_busy(it_spans, "generate"), stage_busy(it_spans, "train")
        derived = {
            # rates over the interval since the previous iteration (what the pipeline delivers):
            # iter_seconds overlap in the async modes, so rates over them were too low
            "perf/samples_per_s": trained / max(res.interval_s, 1e-9),
            "perf/tokens_per_s": out_tokens / max(res.interval_s, 1e-9),
            "time/interval_s": res.interval_s,
            "time/iteration_s": res.iter_seconds,
            "time/generation_s": res.gen_seconds,
            "time/train_wait_s": res.train_seconds,
            "time/generate_busy_s": gen_busy,
            "time/train_busy_s": train_busy,
            "time/weight_sync_s": res.weight_sync_seconds,
            "balance/delta_s": gen_busy - train_busy,
            "staleness/max": float(res.staleness_max),
            # the trainer's version while it trained (a skipped step does not advance it)
            "staleness/gen_version_lag": float(res.version - (0 if res.step_skipped else 1)
                                               - res.gen_version),
            "sgs/redispatched": float(res.redispatched),
            "sgs/instances": float(res.instances),
        }
        derived.update({f"batch/{k}": float(v) for k, v in res.batch.items()})
        derived.update({f"engine/{k}": float(v) for k, v in res.engine.items()})
        for k, v in res.ranker_quality.items():  # the estimates against the true lengths
            if v is not None:
                derived[f"ranker/{k}"] = float(v)
        # the iteration's own window (its dispatch .. the end of its step), not the drain's:
        # a trainer's idle span can start long before (set-up, a pause at the REPL prompt)
        window = iteration_windows(it_spans).get(step)
        if window is not None:
            for device, frac in bubble_fractions(recent, window, per_device=True).items():
                derived[f"idle/{device}"] = frac
        scalars.update(derived)
        for k, v in scalars.items():
            w.add_scalar(k, v, step)
        self.trackers.log(scalars, step)
        row = {k: v for k, v in vars(res).items() if k not in ("out_lens", "gen_lens")}
        append_line(self.logdir / "iterations.jsonl", json.dumps({**row, **derived}))
        if self.timeline_every and (step + 1) % self.timeline_every == 0:
            self._write_timeline_soon(step + 1)
        w.flush()
        return derived

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        w = self._open(step)
        for k, v in scalars.items():
            w.add_scalar(k, float(v), step)
        self.trackers.log({k: float(v) for k, v in scalars.items()}, step)
        w.flush()

    def log_eval(self, ev, step: int, source: str = "periodic") -> dict:
        """An evaluation (``program.EvalResult``) after iteration ``step``: an "eval" span of the
        controller's row, a row of ``eval.jsonl`` (its scores, ``prompts``, ``source``,
        ``seconds``), and TensorBoard:
        ``eval/*`` and ``time/eval_s`` (``source`` "periodic": ``train.eval_every``,
        ``eval_before_train``), or, on demand (``source`` "repl": a REPL ``eval``; "eval_only":
        ``train.eval_only``), ``eval_repl/p<N>/*`` and ``time/eval_repl_p<N>_s`` (``eval_only/...``
        for the other: one curve per prompt count N, apart from the periodic one). A tag gets one
        point per step: an evaluation repeated at the same step is in eval.jsonl only. -> what was
        logged where."""
        if source not in ON_DEMAND and source != "periodic":
            raise ValueError(f"log_eval: source {source!r} is none of periodic, {', '.join(ON_DEMAND)}")
        demand = ON_DEMAND.get(source)
        group, timing = _eval_tags(source, ev.prompts)
        row = {"iteration": step, "source": source, "prompts": ev.prompts,
               "requested": ev.requested, "split": ev.split, "samples_per_prompt": ev.samples,
               "seconds": round(ev.seconds, 4), **ev.scores}
        if ev.weight_versions:  # one, unless instances held different weights (async modes)
            v = ev.weight_versions
            row["weight_version"] = v[0] if len(v) == 1 else list(v)
        # first: a resumed run's first write drops the rows it runs again; an on-demand one (a
        # REPL's, train.eval_only's) drops none: it may evaluate an older checkpoint and train
        # nothing (the REPL's first iteration logged then replaces them: log_iteration)
        self._open(None if demand else step)
        if self.validation_data_dir and ev.generations:  # verl's validation_data_dir: <step>.jsonl
            name = f"{step}.{source}_p{ev.prompts}" if demand else str(step)
            if demand:  # another on-demand eval of this step and count keeps its own file (.2, .3, ...)
                k = 1
                while (Path(self.validation_data_dir) / f"{name}{f'.{k}' if k > 1 else ''}.jsonl").exists():
                    k += 1
                name += f".{k}" if k > 1 else ""
            row["generations"] = str(write_rows(self.validation_data_dir, name,
                                                [{**g, "step": step} for g in ev.generations]))
        append_line(self.logdir / "eval.jsonl", json.dumps(row))
        self._keep([Span(CONTROLLER, "eval", ev.started, ev.started + ev.seconds, step)])
        if (group, step) in self._tb_once:
            return {**row, "tensorboard": f"not logged: {group}* has a point at step {step} already"}
        self._tb_once.add((group, step))
        self.log_scalars({**{group + k.removeprefix("eval/"): v for k, v in ev.scores.items()},
                          timing: ev.seconds}, step)
        if self.log_val_generations and ev.generations:  # verl's log_val_generations
            self._writer.add_text(group + "generations", markdown(ev.generations, self.log_val_generations), step)
            self._writer.flush()
        return {**row, "tensorboard": f"{group}* at step {step}"}

    @contextmanager
    def timed(self, stage: str, step: int):
        """Around a block of the controller's (``stage``: "save", ...): a span of the controller's
        row and, when it completes after iteration ``step`` of this attempt, ``time/<stage>_s``
        at that step. The runner's checkpoint save: ``with metrics.timed("save", next_iteration - 1):``."""
        t0 = time.time()
        try:
            yield
        finally:  # a save that failed (a full disk) took its time too: the trace shows it
            t1 = time.time()
            self._keep([Span(CONTROLLER, stage, t0, t1, step)])
        if step in self._steps and (f"time/{stage}", step) not in self._tb_once:  # one point per step
            self._tb_once.add((f"time/{stage}", step))
            self.log_scalars({f"time/{stage}_s": t1 - t0}, step)

    def _write_timeline_soon(self, upto: int) -> None:
        """``write_timeline(upto)`` on the timeline thread; a write still waiting is replaced."""
        with self._want_lock:
            waiting, self._want = self._want is not None, (upto, self._kept)
        if not waiting:
            self._pool.submit(self._write_wanted)

    def _write_wanted(self) -> None:
        with self._want_lock:
            (upto, n), self._want = self._want, None
        try:
            self._write(upto, n)
        except Exception as e:  # noqa: BLE001 - a figure is not worth the run
            print(f"[controller] timeline files up to iteration {upto - 1} not written: {e!r}; the run goes on",
                  file=sys.stderr, flush=True)

    def write_timeline(self, upto: int, whole: bool = False) -> Path | None:
        """The timeline files of the iterations before ``upto`` (as ``range``): the Gantt figure
        of this attempt's last 400 spans (``timeline.png``; TensorBoard ``timeline/gantt`` at
        step ``upto - 1`` when this attempt logged it, once per step; none with
        ``timeline_every`` 0) and the Chrome trace (``timeline.json``) of this attempt's latest
        ``KEEP_SPANS`` spans, or with ``whole`` (the run's end) of every attempt's, read back
        from ``spans.jsonl``; both files are replaced atomically."""
        return self._write(upto, self._kept, whole)

    def _write(self, upto: int, n: int, whole: bool = False, last: int = 400) -> Path | None:
        if not self.timeline_files:
            return None
        with self._write_lock:
            if not whole and n <= self._whole_at:  # a queued write that the run's end overtook: its
                return None  # trace of this attempt only would replace the whole run's (review, s53)
            with self._spans_lock:
                held, kept = list(self.spans), self._kept
            spans = held[:max(len(held) - (kept - n), 0)]  # those kept when the write was asked
            # 0: no figure (the Chrome trace is still written); none new since the last, or an
            # attempt that trained nothing (a REPL that only inspected): the run's figure stands
            if self.timeline_every and n != self._written and self._steps:
                self._figure(spans[-last:], upto - 1)
            out = write_chrome_trace(load_spans(self.logdir / SPANS) if whole else spans,
                                     self.logdir / "timeline.json")
            self._written = n
            if whole:
                self._whole_at = n
            return out

    def _figure(self, spans: list[Span], step: int) -> None:
        fig = gantt_figure(spans, f"timeline up to iteration {step}")
        if step in self._steps and ("timeline/gantt", step) not in self._tb_once:
            self._open(step).add_figure("timeline/gantt", fig, step, close=False)
            self._open(step).flush()
            self._tb_once.add(("timeline/gantt", step))
        with atomic_file(self.logdir / "timeline.png") as tmp:
            fig.savefig(tmp, dpi=100, format="png")

    def summary(self) -> dict:
        """The final JSON's metrics. The whole run (every attempt): ``iterations``,
        ``reward_first`` / ``reward_last`` (means over its first / last tenth). This attempt
        (from ``resumed_at``, 0 for a fresh run): ``attempt_iterations``, ``samples_per_s``,
        ``tokens_per_s`` (over the runner's ``rl_seconds``), ``skipped_samples``."""
        n = len(self.rewards)
        k = max(1, n // 10)
        return {"reward_first": sum(self.rewards[:k]) / k if n else 0.0,
                "reward_last": sum(self.rewards[-k:]) / k if n else 0.0,
                "iterations": n, "resumed_at": n - len(self._steps), "attempt_iterations": len(self._steps),
                "samples_per_s": self.samples / max(self.seconds, 1e-9),
                "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                "skipped_samples": self.skipped}

    def close(self, exit_code: int = 0) -> None:
        """Finish: wait for a timeline write in progress, write the timeline files once more
        when spans came since the last write (the end of a run, or a crash or Ctrl-C when the
        runner calls this on its way out), close TensorBoard. Safe to call twice."""
        self._pool.shutdown(wait=True)
        if self._kept and self._whole_at != self._kept:  # the run's end: the whole trace, once
            try:
                self._write(max(self._steps, default=-1) + 1, self._kept, whole=True)
            except Exception as e:  # noqa: BLE001 - on the way out: say so, keep the exit's own error
                print(f"[controller] timeline files not written: {e!r}", file=sys.stderr, flush=True)
        if self._writer is not None:
            self._writer.close()
        self.trackers.close(exit_code)


def _eval_tags(source: str, prompts: int) -> tuple[str, str]:
    """An evaluation's TensorBoard tag group and timing tag: ``eval/``, ``time/eval_s``
    (periodic), or ``eval_repl/p<N>/``, ``time/eval_repl_p<N>_s`` (on demand: one curve per
    prompt count; ``eval_only/...``)."""
    demand = ON_DEMAND.get(source)
    return (f"{demand}/p{prompts}/", f"time/{demand}_p{prompts}_s") if demand else ("eval/", "time/eval_s")


def _purge_from(writer: SummaryWriter, step: int) -> None:
    """Have TensorBoard drop the run's points at ``step`` and later (an abandoned lineage's):
    two ``SessionLog.START`` events at ``step``. Readers purge on a START (what
    ``SummaryWriter(purge_step=...)`` writes, once), but the TensorBoard server's reader takes a
    run folder's first START as its session's start and purges nothing on it: a run's first
    resume from an older checkpoint left both lineages' points in the UI (flows review, s59).
    The second START purges there; a reader that purges on every one purges twice, the same."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    for _ in range(2):
        writer.file_writer.add_event(Event(step=step, wall_time=time.time(),
                                           session_log=SessionLog(status=SessionLog.START)))
