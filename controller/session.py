"""The controller's session on rank 0: one run's state and the calls that drive it.

``Session(cfg, args, world_size)`` sets the run up (run folder checks, task, model bootstrap,
worker groups, prompt check, resume, ranker); ``run()`` runs the program (or the REPL) and
returns the summary the run prints as its JSON line. Its per-iteration hook logs, evaluates,
checkpoints and feeds the scale-out policy. Ending the run and stopping the workers is
``controller.runner``'s.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from controller import checkpoint as ckpt
from controller.bootstrap import ensure_model
from controller.config import ConfigError
from controller.epochs import with_epochs
from controller.evaluation import evaluate, measure_lengths
from controller.val_metrics import is_headline
from controller.joiners import admit, waiting
from controller.length_trace import forced_lengths
from controller.metrics import Metrics
from controller.planner.adjust import ScaleOutPolicy
from controller.program import Program
from controller.run_record import plain, save_run_config
from controller.process_state import LOCAL
from controller.rpc import SETUP_FACTOR, WorkerFailed, call_on, wait_all
from controller.stops import RunStopped
from controller.trackers import Fanout, make_trackers
from controller.preflight import (check_model_folder, check_writable, lock_run_folder, refuse_fresh_start_over_a_run,
                                  refuse_previous_run, resumed_logdir)
from controller.ranker_setup import run_ranker, saved_ranker
from controller.resume_check import checked_resume
from controller.world import build_world, check_engine
from workers.generation.config import engine_context
from workers.model import stop_ids
from workers.model_config import ModelConfig
from workers.types import Ranker, prompt_text


class Session:
    def __init__(self, cfg, args, world_size: int):
        from controller.prompt_check import check_demonstrations, checked_task
        from controller.scheduling import make_dispatcher
        from workers.tasks.envs.tools import run_tools
        from workers.tasks.registry import make_task
        from workers.tokenizer import Tokenizer

        self.cfg, self.args = cfg, args
        self.logdir = resumed_logdir(Path(cfg.logging.logdir), args.resume) if args.resume else \
            Path(cfg.logging.logdir)
        LOCAL.run_folder = str(self.logdir)
        self.static_ranks = set(range(1, world_size))
        self.joined: list[int] = []
        self.waiting: list[int] = []
        self.departed: list[int] = []  # joined processes told to exit during the run (refused, or ``leave``)
        self.want_add = False
        if not args.resume:
            refuse_previous_run(self.logdir)
        else:
            refuse_fresh_start_over_a_run(self.logdir, args.resume)
        check_writable(self.logdir)
        self._lock = lock_run_folder(self.logdir)
        self._record = save_run_config(self.logdir, cfg, args)
        if cfg.placement.elastic:  # after the checks: a run refused at start has no address to join
            host = os.environ.get("MASTER_ADDR", "")
            local = ("; this host only: from another host, use this node's address with the same port"
                     if host in ("localhost", "127.0.0.1", "::1") else "")
            print(f"[controller] join address {host}:{os.environ.get('MASTER_PORT')} "
                  f"(python controller/main.py --join ADDR --role generation{local})", file=sys.stderr, flush=True)
        # the task and the dispatcher first: a bad task.kwargs or dispatch.options fails in
        # a second, before the model bootstrap (SFT) spends minutes
        try:
            task = make_task(cfg.task.name, **dict(cfg.task.kwargs))
        except (ValueError, OSError, ImportError) as e:  # a bad verifier, kwargs, data path
            raise ConfigError(str(e)) from None
        # its data read and checked once, before the SFT
        self.task = checked_task(task, cfg.task.name, ("train", "test") if cfg.train.evaluates else ("train",))
        # train.epochs: a length that no prompt check can make right (fewer prompts than a batch, a
        # warmup past the schedule) is said now, before the SFT and the engines; derived at start
        with_epochs(cfg, len(self.task.prompts("train")))
        if cfg.model.init and not (Path(cfg.model.path) / "config.json").exists():  # the bootstrap's SFT will run
            check_demonstrations(task, cfg.task.name)
        length_of = (forced_lengths(cfg.train.length_trace, cfg.train.length_scale, cfg.train.max_tokens)
                     if cfg.train.length_trace else None)
        dispatcher = make_dispatcher(cfg.dispatch.name, **dict(cfg.dispatch.options))
        saved = saved_ranker(cfg)  # loaded now: a damaged one fails before the bootstrap
        check_model_folder(Path(cfg.model.path), cfg.model.init)
        check_engine(cfg.engine, cfg.placement.generation, cfg.placement.rpc_timeout_s)
        boot = call_on(sorted(cfg.placement.trainer)[0], "trainer", ensure_model,
                       args=(cfg.model.path, cfg.model.init, cfg.task.name, dict(cfg.task.kwargs),
                             cfg.train.sft_steps, cfg.train.sft_lr, cfg.train.seed,
                             cfg.tokenizer.prompt_template or None),
                       timeout=cfg.placement.rpc_timeout_s * SETUP_FACTOR)
        self.boot = boot
        self.model_dir = boot["path"]
        try:  # multi_turn.tools (checked at load; read again here: what every prompt shows)
            tools = run_tools(cfg.multi_turn)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:  # a model folder's own chat template / prompt template
            self.tok = Tokenizer.load(self.model_dir, cfg.tokenizer.prompt_template or None, tools=tools,
                                      template_kwargs=cfg.tokenizer.chat_template_kwargs)
        except ValueError as e:
            raise ConfigError(f"model.path {self.model_dir}: tokenizer: {e}") from None
        try:
            self.eos_ids = stop_ids(self.model_dir, self.tok.eos_id)
        except ValueError as e:  # a config.json / generation_config.json that is no JSON object, a bad id
            raise ConfigError(f"model.path: {e}") from None
        mc = ModelConfig.from_hf(json.loads((Path(self.model_dir) / "config.json").read_text()))
        self.vocab_size = mc.vocab_size
        try:  # a max_model_len past the model's context: one config line, not each engine's traceback
            engine_context(cfg.engine, mc.max_position_embeddings, cfg.engine.kv_len)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.world = build_world(cfg, self.model_dir, self.eos_ids, self.static_ranks, dispatcher, self.tok)
        self.task = self._fitting_task(self.task)
        cfg = self.cfg  # train.epochs: with the iterations derived from the kept prompts
        lg = cfg.logging
        # an eval-only run writes its evaluation beside the run's logs, nothing else of them: no
        # timeline files, and no tracker (its wandb run is the training run's, whose steps only grow)
        self.metrics = Metrics(self.logdir, lg.timeline_every, None, lg.validation_data_dir, lg.log_val_generations,
                               timeline_files=not cfg.train.eval_only)
        self.policy = self._scale_policy()
        self.resumed_from = None  # the checkpoint folder resumed from
        self._lineage = None  # (that checkpoint, its iteration): `latest` when this session first trains
        self._saved: tuple | None = None  # (iteration, folder) of this run folder's newest checkpoint
        state = self._resume() if args.resume else None
        self.program = Program(cfg, self.world, self.tok, self.task, None, self._on_iteration,
                               stream_state=state.stream if state else None,
                               start_iteration=state.iteration if state else 0,
                               version=state.version if state else 0)
        if length_of is not None:
            self.program.length_of = length_of
        # the ranker reads prompt texts; its bootstrap measures each as the run prompts it (a chat
        # with its system turn, truncated as train.overlong_prompts says), not as a bare text
        texts = [prompt_text(it) for it in self.task.prompts("train")]
        item_of = dict(zip(texts, self.task.prompts("train")))

        def measure(ps: list[str]) -> list[float]:
            return measure_lengths(self.program, [item_of.get(t, t) for t in ps])

        self.ranker: Ranker | None = run_ranker(cfg, saved, self.resumed_from, measure, texts,
                                                span=lambda: self.program.spans.span("ranker", self.program.iteration))
        self.program.ranker = self.ranker
        if state:
            self.metrics.rewards = list(state.rewards)
            self.program.ranker_rows = list(state.ranker_rows)
        self.program.before_iteration = lambda i: admit(self, i)
        self.progress = None
        # the trackers last, once the start can no longer be refused: a refused --resume (a
        # damaged checkpoint) resumed the folder's wandb run and left it unfinished (review, s53)
        self.metrics.trackers = Fanout(make_trackers([] if cfg.train.eval_only else lg.trackers, self.logdir,
                                                     lg.project, lg.experiment, plain(cfg)))

    # ---- set-up helpers ------------------------------------------------------------------
    def _fitting_task(self, task):
        """The task with its prompts checked against the engines' smallest context
        (``prompt_check.check_task``); the SGS keeps what a joiner must hold."""
        from controller.prompt_check import chat_without_template_note, check_task, tools_without_template_note
        stats = wait_all([h.call("stats") for h in self.world.sgs.handles])
        fitting, self.world.sgs.need = check_task(
            task, self.cfg.train, self.cfg.task.name, min(st.max_model_len for st in stats),
            lambda item: self.tok.encode_prompt(item.prompt, item.messages), self.vocab_size, repl=self.args.repl)
        for note in (chat_without_template_note(fitting.prompts("train"), bool(self.tok.chat_template)),
                     tools_without_template_note(self.tok.tools, bool(self.tok.chat_template))):
            if note:
                print(f"[controller] {note}", file=sys.stderr, flush=True)
        self._derive_length(len(fitting.prompts("train")), len(task.prompts("train")))
        return fitting

    def _derive_length(self, kept: int, total: int) -> None:
        """``train.epochs``: the run's iterations (and the LR schedule's length, on every trainer
        rank) from the ``kept`` train prompts, before anything trains or a checkpoint is loaded."""
        cfg, line = with_epochs(self.cfg, kept, total - kept)
        if line is None:
            return
        if cfg.trainer.total_steps != self.cfg.trainer.total_steps:
            wait_all([t.call("set_total_steps", cfg.trainer.total_steps) for t in self.world.trainers])
        self.cfg = cfg
        save_run_config(self.logdir, cfg, self.args, self._record.name)  # with the derived length
        print(f"[controller] {line}", file=sys.stderr, flush=True)

    def _scale_policy(self):
        if not self.cfg.placement.elastic:
            return None
        # delta' as the run's own dispatcher would save (the oracle's saving is not the run's); your
        # own dispatcher is not run on what-ifs (its plan() may log, keep state, cost): the oracle's
        from controller.scheduling import DISPATCHERS

        d = self.cfg.dispatch
        if d.name not in DISPATCHERS:
            return ScaleOutPolicy(self.world.sgs.slots[0].profile)
        return ScaleOutPolicy(self.world.sgs.slots[0].profile, d.name, dict(d.options))

    def _resume(self):
        got = checked_resume(self.args.resume, self.cfg, self.model_dir)
        if got is None:
            return None
        found, state = got
        versions = wait_all([t.call("load_checkpoint", str(found / "trainer")) for t in self.world.trainers])
        self.resumed_from = found
        if found.parent.resolve() == (self.logdir / "checkpoints").resolve() and not self.cfg.train.eval_only:
            # this folder's lineage continues from here once it trains (an evaluation, nothing to
            # train, or a console that only inspects: none); a console's first `run` points it
            self._lineage = (found, state.iteration)
            if state.iteration < self.cfg.train.iterations and not self.args.repl:
                self.continue_lineage()
        self._saved = (state.iteration, found)
        if state.mode != self.cfg.pipeline.mode:  # a REPL `mode` before that save; the config rules
            print(f"[controller] the checkpoint was saved in pipeline.mode {state.mode!r}; this run uses its "
                  f"config's {self.cfg.pipeline.mode!r} (--set pipeline.mode={state.mode} to keep that one)",
                  file=sys.stderr, flush=True)
        wait_all(self.world.push_weights(versions[0]))
        state.version = versions[0]
        print(f"[controller] resumed from {found}: iteration {state.iteration}, version {state.version}",
              file=sys.stderr, flush=True)
        if state.iteration >= self.cfg.train.iterations and not self.cfg.train.eval_only:
            key = "train.epochs" if self.cfg.train.epochs is not None else "train.iterations"
            print(f"[controller] that run is complete (iteration {state.iteration} of train.iterations "
                  f"{self.cfg.train.iterations}): nothing to train; raise {key} "
                  f"(--set {key}=N) to continue it", file=sys.stderr, flush=True)
        return state

    def continue_lineage(self) -> None:
        """The checkpoint resumed from, in this run's own folder, becomes ``latest`` before this
        session trains (a stop before its next save then resumes this lineage, not abandoned newer
        checkpoints); a session that never trains (a REPL that only evaluates) leaves it as it was."""
        if self._lineage is not None:
            found, iteration = self._lineage
            ckpt.point_latest(found)
            # the abandoned iterations' rollout files go, as their rows leave iterations.jsonl
            wait_all([t.call("drop_rollouts_from", iteration) for t in self.world.trainers])
            self._lineage = None

    def _drain_last_spans(self) -> None:
        """The workers' spans recorded after the last iteration was logged (the evaluation after
        the last iteration, a REPL ``eval`` before ``quit``), into the trace; best effort: the
        run's outcome is not this."""
        try:
            self.metrics.add_spans(self.program.drain_spans())
        except Exception as e:  # noqa: BLE001 - a worker gone at the end costs its last spans only
            print(f"[controller] the workers' last spans were not collected ({error_line(e)})", file=sys.stderr,
                  flush=True)

    # ---- per-iteration hooks ---------------------------------------------------------------
    def _on_iteration(self, res) -> None:
        spans = self.program.drain_spans()
        derived = self.metrics.log_iteration(res, spans)
        if res.nothing_trainable:
            skipped, unbased = res.skipped_samples, res.groups_without_baseline
            self._stop_untrained(res, f"step {res.iteration}: all {skipped} samples were skipped, so nothing was "
                                      "trained; the trainer ranks' warnings say why: a reward that raised or was not a "
                                      "finite number ('the task's score raised ...'), samples refused as bad input, or "
                                      "non-finite sampler log-probs (a diverged policy: a lower trainer.lr)"
                                 if skipped and not res.num_samples else
                                 f"step {res.iteration}: nothing was trained, and {unbased} groups got no greedy "
                                 "baseline response (remax), so their samples could not train; the trainer ranks' "
                                 "warnings say why")
        c = self.cfg
        if self.policy is not None:
            lens = res.gen_lens  # remax's greedy responses take generation time too
            if lens:
                # processes waiting to join that can still come (the announce queue held those
                # that withdrew or died too: the decision claimed an instance nobody could bring)
                self.waiting = waiting(self.waiting)
                spare = len(self.waiting)
                d = self.policy.observe(res.iteration, derived["time/generate_busy_s"],
                                        derived["time/train_busy_s"], lens, res.instances, spare=spare)
                # the latest decision: a joiner arriving later is added at the next decision that still wants one
                self.want_add = d.add
                self.metrics.log_scalars({"balance/delta_prime_s": d.delta_prime_s}, res.iteration)
        last = res.iteration + 1 == c.train.iterations  # evaluated too, as verl's is_last_step
        if c.train.eval_every and ((res.iteration + 1) % c.train.eval_every == 0 or last):
            self.metrics.log_eval(evaluate(self.program, c.train.eval_prompts, res.iteration), res.iteration)
        if c.train.ckpt_every and (res.iteration + 1) % c.train.ckpt_every == 0:
            self.save_checkpoint(res.iteration + 1)
        if self.progress is not None:
            self.progress.update(self.task_id, advance=1,
                                 description=f"RL {c.pipeline.mode} reward (last iteration) "
                                             f"{res.reward_mean:.3f}")
        if c.logging.progress and (self.progress is None or not self.progress.console.is_terminal):
            # a log file, a pipe or the REPL: rich draws its bar only at the end there
            of = f"/{c.train.iterations}" if res.iteration < c.train.iterations else ""  # a REPL `run` may go on
            got, trained = res.num_samples, res.trained
            kept = f" ({trained} trained)" if self.cfg.trainer.filter_groups and trained != got else ""
            print(f"[controller] iteration {res.iteration + 1}{of} (step {res.iteration}, {self.program.mode.name}): "
                  f"reward {res.reward_mean:.3f}, {got} samples{kept}, "
                  f"{derived.get('time/interval_s', 0.0):.2f} s", file=sys.stderr, flush=True)

    def _stop_untrained(self, res, why: str) -> NoReturn:
        """Stop the run at a step that trained nothing (a reward service down, every sample
        refused), checkpointed to retry that step: the trainers are alive and a step that applies
        no update leaves their state (weights, optimizer, LR schedule, version) as the step before
        left it, so the work since the last ``train.ckpt_every`` save is kept (review, s57)."""
        try:
            saved = self.save_checkpoint(res.iteration)
        except RunStopped as e:  # the save failed too (a full disk): both are said
            raise RunStopped(f"{why}; {e}") from None
        raise RunStopped(f"{why}; the checkpoint {saved} retries step {res.iteration} once that is fixed")

    def _evaluate_and_say(self, step: int, source: str = "periodic") -> None:
        """An evaluation of the weights the engines hold, logged at ``step`` and said on stderr:
        ``train.eval_before_train``'s (step -1) and ``train.eval_only``'s."""
        logged = self.metrics.log_eval(evaluate(self.program, self.cfg.train.eval_prompts, step), step, source)
        scores = ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in logged.items()  # (not the statistics)
                           if is_headline(k))
        if logged.get("eval/unscored"):
            scores += f"{', ' if scores else ''}{int(logged['eval/unscored'])} samples unscored"
        when = "before training" if step < 0 else f"after iteration {step + 1} (step {step})"
        print(f"[controller] evaluation {when} (weight version {logged.get('weight_version', 0)}, "
              f"{logged['prompts']} prompts): {scores}", file=sys.stderr, flush=True)

    def save_checkpoint(self, next_iteration: int) -> Path:
        state = ckpt.ControllerState(next_iteration, self.program.version,
                                     self.program.stream_state_at(next_iteration),
                                     self.program.mode.name, self.metrics.rewards[:next_iteration], {},
                                     list(self.program.ranker_rows))

        root = self.logdir / "checkpoints"
        self.program.settle_push()  # outside the save's errors: a failed push is the push's
        try:
            with self.metrics.timed("save", next_iteration - 1):
                saved = ckpt.save(root, state, self.program.save_trainers,
                                  self.ranker if self.cfg.ranker.update_every else None)
        except (OSError, ValueError, WorkerFailed) as e:  # a full disk, an unwritable folder (here or on the trainer)
            if isinstance(e, WorkerFailed) and e.lost:
                raise
            kept = ckpt.find(root) if root.is_dir() else None
            free = shutil.disk_usage(root if root.is_dir() else self.logdir).free if self.logdir.is_dir() else None
            raise RunStopped(f"the checkpoint of iteration {next_iteration} could not be written under {root}"
                             + (f" ({free / 2**20:.0f} MiB free there)" if free is not None else "")
                             + f": {error_line(e)}; " + (f"the last checkpoint, {kept}, is intact" if kept else
                                                          "no checkpoint was written before")) from None
        if self.cfg.train.ckpt_keep is not None:  # the checkpoint resumed from stays, for another try from it
            ckpt.prune(root, self.cfg.train.ckpt_keep,
                       protect=[saved, self.resumed_from] if self.resumed_from else [saved])
        self._saved = (next_iteration, saved)
        return saved

    def final_checkpoint(self) -> Path:
        """The run's last checkpoint: the one already written for this iteration (by
        ``train.ckpt_every``, or the one resumed from when nothing was trained) when it is in
        this run folder, else a new one (a checkpoint is model + optimizer: not written twice)."""
        it, folder = self._saved or (None, None)  # (the mode it records is not read on resume)
        if it == self.program.iteration and folder.resolve().parent == (self.logdir / "checkpoints").resolve():
            return folder
        return self.save_checkpoint(self.program.iteration)

    # ---- run ---------------------------------------------------------------------------------
    def run(self) -> dict:
        c = self.cfg
        remaining = c.train.iterations - self.program.iteration
        if self.args.repl:
            from controller.repl import Repl

            Repl(self).loop(sys.stdin, sys.stdout)
        elif c.train.eval_only:
            self._evaluate_and_say(self.program.iteration - 1, "eval_only")
        elif remaining > 0:
            if c.train.eval_before_train and self.program.iteration == 0:  # a resumed run has its evaluations
                self._evaluate_and_say(-1)
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=Console(file=sys.stderr), disable=not c.logging.progress) as progress:
                self.progress = progress
                self.task_id = progress.add_task(f"RL {c.pipeline.mode}", total=remaining)
                self.program.run(remaining, keep=False)
                self.progress = None
        # an eval-only run's weights are those it started from: the checkpoint resumed from, or
        # (fresh) nothing of this run's worth a copy
        final = self.resumed_from if c.train.eval_only else self.final_checkpoint()
        self._drain_last_spans()
        if self.metrics.spans:
            self.metrics.write_timeline(self.program.iteration, whole=True)
        summary = self.metrics.summary()  # samples_per_s, tokens_per_s: over rl_seconds
        summary.update(logdir=str(self.logdir), checkpoint=str(final) if final else None, mode=self.program.mode.name,
                       rl_seconds=self.metrics.seconds,
                       bootstrap_seconds=self.boot["seconds"], bootstrap_sft=self.boot["sft"],
                       instances=len(self.world.sgs.slots))
        self.metrics.close()
        return summary


def error_line(e: BaseException) -> str:
    """The exception's own line (``OSError: [Errno 28] No space left on device``): for a worker's
    error, the last line of its remote traceback that names one."""
    if not isinstance(e, WorkerFailed):
        return f"{type(e).__name__}: {e}"
    lines = [ln.strip() for ln in str(e).splitlines()]
    named = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
    return named[-1] if named else lines[0]
