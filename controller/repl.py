"""Interactive console on the controller (``--repl``), reading rank 0's stdin under torchrun.

Commands (one per line)::

    run K              run K iterations in the current mode (pipeline drained after)
    sgs                generation instances: running / waiting requests, KV blocks, version;
                       instances found lost are removed; joined processes waiting to be added
    trainer            trainer ranks: version, queued iterations
    timeline [N]       bubble fraction per device and stage seconds over the last N spans (200),
                       within the iterations' windows
    mode NAME          switch pipeline mode (same placement kind) between iterations
    dispatch NAME [k=v ...]   switch the dispatcher (controller.scheduling names)
    eval [N]           score N test prompts (32; 0: all), as train.eval_*; a row of eval.jsonl,
                       TensorBoard eval_repl/p<N>/* (once per iteration and N)
    save               write a checkpoint now
    leave RANK         scale in: generation instance RANK stops taking prompts; a process that
                       joined with --join closes its engine and exits (code 0), a torchrun
                       rank stays idle until the job ends; a joined process still waiting to
                       be added is dismissed; a lost instance is removed
    rejoin RANK        scale out again: a torchrun rank that left takes prompts again (it
                       pulls the current weights first)
    status             iteration, weight version, mode, last reward, instances, waiting joiners
    help | quit

Every command's answer is printed as one line starting with ``>>> `` then JSON, so a
script (or a test) can drive the console through stdin and read the answers; ``help`` prints
its text as plain lines before its answer, and a terminal (stdin a TTY) gets a ``streamrl> ``
prompt, which a pipe does not. What is typed never stops the run: a bad line or argument is
answered ``{"error": ...}``, and so is a worker's error in a command that leaves the pipeline
alone (``eval``, ``save``, ``sgs``, ...).
A failure inside ``run`` (a worker's, the last generation instance lost, an iteration that
trained nothing) is not an answer: it left an iteration half done (registered with the
trainers, samples in flight), so it ends the session and the run (exit 1), as without the
REPL.
"""
from __future__ import annotations

import inspect
import json
import re
import shlex
import textwrap
from dataclasses import asdict

from controller.evaluation import evaluate
from controller.rpc import WorkerFailed, wait_all
from controller.switches import switch_dispatcher, switch_mode
from controller.timeline import bubble_fractions, iteration_windows, stage_times


class Repl:
    def __init__(self, session):
        self.s = session
        self.stdout = None  # the loop's (None: sys.stdout)
        self._in_run = False  # inside program.run (a failure there ends the session)
        self.commands = {
            "run": self.run, "sgs": self.sgs, "trainer": self.trainer, "timeline": self.timeline,
            "mode": self.mode, "dispatch": self.dispatch, "eval": self.eval, "save": self.save,
            "status": self.status, "help": self.help, "leave": self.leave, "rejoin": self.rejoin,
        }
        self._parked: dict = {}  # torchrun rank that left -> (its handle, its SGS profile): rejoin takes it back

    def loop(self, stdin, stdout) -> None:
        self.stdout = stdout
        if hasattr(stdin, "reconfigure"):  # a stray byte (a Latin-1 paste) must not end the run: read as U+FFFD
            stdin.reconfigure(errors="replace")
        prompt = PROMPT if stdin.isatty() else ""
        print(">>> " + json.dumps({"ready": True, "commands": sorted(self.commands) + ["quit"]}), file=stdout, flush=True)
        while True:
            if prompt:
                print(prompt, end="", file=stdout, flush=True)
            line = stdin.readline()
            if not line:  # EOF (Ctrl-D on a terminal: end the prompt's line)
                print(end="\n" if prompt else "", file=stdout, flush=True)
                break
            try:  # a bad line or command must not end the session (nor the run)
                words = shlex.split(line.strip())
                if words and words[0] in ("quit", "exit"):
                    break
                if not words:
                    continue
                fn = self.commands.get(words[0])
                if fn is None:
                    out = {"error": f"unknown command {words[0]!r}; try help"}
                else:
                    try:
                        inspect.signature(fn).bind(*words[1:])
                    except TypeError:  # a missing or extra argument: the command's usage, not Python's words
                        out = {"error": f"usage: {usage(words[0])}"}
                    else:
                        out = fn(*words[1:])
            except Exception as e:  # noqa: BLE001
                out = {"error": f"{type(e).__name__}: {e}"}
                if self._in_run:  # mid-iteration: the pipeline cannot go on (runner: exit 1)
                    print(">>> " + json.dumps({**out, "fatal": True}), file=stdout, flush=True)
                    raise
            print(">>> " + json.dumps(out, default=str), file=stdout, flush=True)

    # ---- commands ------------------------------------------------------------------------
    def run(self, k: str = "1") -> dict:
        n = _count("run", k)
        sgs = self.s.world.sgs
        self._live_stats()  # an instance found lost leaves the SGS now, not in the run's round
        if not sgs.slots:  # every instance lost (it used to fail the job: NoInstancesLeft in the run)
            from controller.joiners import admit

            waited = bool(self._waiting())
            admit(self.s, self.s.program.iteration)  # one waiting is added now (none left: whatever the policy)
            if not sgs.slots:
                return {"error": "run: no generation instance is left (" + ", ".join(
                    f"rank {r}: {why}" for r, why in sgs.removed) + "); " + (
                    "the process waiting was not added (the controller's log says why); " if waited else "")
                    + _how_to_add()}
        note = self._past_schedule(n)
        self._in_run = True  # from here a failure is the run's, not the command's
        self.s.continue_lineage()
        res = self.s.program.run(n)
        self._in_run = False
        out = {"ran": len(res), "iteration": self.s.program.iteration, "version": self.s.program.version,
               "reward": [round(r.reward_mean, 4) for r in res]}
        return {**out, "note": note} if note else out

    def _past_schedule(self, n: int) -> str:
        """What iterations past the LR schedule's end train at (a decaying schedule stays at its
        last value, lr x min_lr_ratio: 0 by default), when this run goes there."""
        t = self.s.cfg.trainer
        past = self.s.program.iteration + n - t.total_steps
        if past <= 0 or t.lr_schedule == "constant":
            return ""
        return (f"{min(past, n)} of these iterations go past trainer.total_steps ({t.total_steps}, the "
                f"{t.lr_schedule} schedule's length): they train at lr x min_lr_ratio = {t.lr * t.min_lr_ratio:g}")

    def _live_stats(self) -> dict[int, object]:
        """Each instance's stats, rank -> stats; an instance found lost is removed from the SGS
        (one dead instance used to hide every other's stats, and stay counted)."""
        sgs, out = self.s.world.sgs, {}
        for h, call in [(h, h.call("stats")) for h in sgs.handles]:
            try:
                out[h.rank] = call.wait()
            except WorkerFailed as e:
                sgs.remove_lost(e, "a REPL command")  # any other failure is the command's error
        return out

    def _waiting(self) -> list[int]:
        """Joined processes not yet added (the scale-out policy adds them at an iteration)."""
        from controller.joiners import announced, still_waiting

        self.s.waiting = still_waiting(self.s.waiting) + announced()
        return list(self.s.waiting)

    def sgs(self) -> dict:
        return {"instances": [st.flat() for st in self._live_stats().values()],
                "removed": self.s.world.sgs.removed, "waiting": self._waiting()}

    def trainer(self) -> dict:
        return {"ranks": [asdict(st) for st in wait_all([t.call("stats") for t in self.s.world.trainers])]}

    def timeline(self, last: str = "200") -> dict:
        spans = list(self.s.metrics.spans)[-_count("timeline", last):]
        # over the iterations' windows: the pauses between `run` commands are nobody's bubble,
        # and no stage's time (a trainer's idle span lasts through them)
        windows = list(iteration_windows(spans).values()) or None
        return {"spans": len(spans), "bubble": bubble_fractions(spans, windows, per_device=True),
                "stage_s": stage_times(spans, windows)}

    def mode(self, name: str) -> dict:
        switch_mode(self.s.program, name)
        return {"mode": name}

    def dispatch(self, name: str, *kv: str) -> dict:
        from controller.config_overrides import parse_override

        opts = dict(parse_override(x) for x in kv)
        switch_dispatcher(self.s.program, name, **opts)
        return {"dispatch": name, "options": opts}

    def eval(self, n: str = "32") -> dict:
        want = 0 if n.strip() == "0" else _count("eval", n)  # 0: the whole split
        # at the iteration just trained (-1 before any), as the periodic evals: a resume from a
        # checkpoint saved after it replaces the steps from the next iteration on, not this row
        step = self.s.program.iteration - 1
        ev = evaluate(self.s.program, want, step)
        out = self.s.metrics.log_eval(ev, step, source="repl")
        if want > ev.split:
            out["note"] = f"asked for {want} prompts; the test split has {ev.split}: evaluated all of them"
        return out

    def save(self) -> dict:
        return {"checkpoint": str(self.s.save_checkpoint(self.s.program.iteration))}

    def leave(self, rank: str) -> dict:
        sgs = self.s.world.sgs
        if not rank.isdigit():
            return {"error": f"leave: expected a generation instance's rank (see sgs), got {rank!r}"}
        from controller.joiners import dismiss_joiner

        if int(rank) in self._waiting():  # joined, never added: nothing to stop
            self.s.waiting.remove(int(rank))
            dismiss_joiner(int(rank), 0, "dismissed (REPL leave) before it was added")
            self.s.departed.append(int(rank))
            return {"left": int(rank), "process": "exits (joined with --join, not yet added): exit code 0"}
        handle = next((h for h in sgs.handles if h.rank == int(rank)), None)
        if handle is None:
            return {"error": f"no generation instance on rank {rank}"}
        live = self._live_stats()  # a lost one is removed here: it must not count as the other
        if handle.rank not in live:
            return {"left": handle.rank, "lost": True, "instances": [h.rank for h in sgs.handles]}
        if len(live) == 1:
            return {"error": "the last generation instance cannot leave"}
        try:
            handle.call("stop").wait()
        except WorkerFailed as e:  # lost between the two calls
            sgs.remove_lost(e, "leave")
            return {"left": handle.rank, "lost": True, "instances": [h.rank for h in sgs.handles]}
        profile = next(s.profile for s in sgs.slots if s.handle.rank == handle.rank)
        sgs.remove(handle.rank, reason="left (REPL)")
        out = {"left": handle.rank, "instances": [h.rank for h in sgs.handles]}
        if handle.rank in self.s.static_ranks:
            # a torchrun rank does not exit early: the static ranks' process group cannot drop
            # a member, and the run's exit barriers wait for every one of them
            self._parked[handle.rank] = (handle, profile)
            out["process"] = "stays (a torchrun rank): idle, holding its engine, until the job ends or rejoin"
            return out
        try:  # its engine (and vLLM's engine process) goes now, then the process itself
            handle.call("close").wait()
        except WorkerFailed:
            pass  # gone already
        dismiss_joiner(handle.rank, 0, "left the job (REPL leave): instance closed, nothing more to serve")
        self.s.departed.append(handle.rank)
        out["process"] = "exits (joined with --join): instance closed, exit code 0"
        return out

    def rejoin(self, rank: str) -> dict:
        if not rank.isdigit():
            return {"error": f"rejoin: expected the rank of a torchrun generation rank that left (sgs), got {rank!r}"}
        parked = self._parked.pop(int(rank), None)
        if parked is None:
            return {"error": f"rejoin: rank {rank} is no torchrun rank that left with `leave` (a joined process "
                             "that left has exited: start a new --join process)"}
        handle, profile = parked
        version = self.s.program.version
        try:  # as a joiner is added: the current weights first, then it takes prompts
            handle.call("resume").wait()
            wait_all(self.s.world.push_weights(version, only=[handle]))
            handle.call("hold_weights", version).wait()
        except WorkerFailed as e:
            if not (e.lost and e.role == "generation"):
                raise
            return {"error": f"rejoin: rank {rank} was lost: {str(e).splitlines()[0]}"}
        sgs = self.s.world.sgs
        sgs.add(handle, profile)
        sgs.removed = [(r, why) for r, why in sgs.removed if r != handle.rank]  # `sgs` lists it live, not gone
        return {"rejoined": handle.rank, "version": version, "instances": [h.rank for h in self.s.world.sgs.handles]}

    def status(self) -> dict:
        p = self.s.program
        # this attempt's last iteration, else the checkpoint's (after --resume, before any run)
        last = p.history[-1].reward_mean if p.history else \
            (self.s.metrics.rewards[-1] if self.s.metrics.rewards else None)
        return {"iteration": p.iteration, "version": p.version, "mode": p.mode.name, "reward": last,
                "instances": len(self.s.world.sgs.slots), "waiting": self._waiting()}

    def help(self) -> dict:
        print(_COMMANDS, file=self.stdout, flush=True)  # readable on a terminal; the answer follows
        return {"help": _USAGES}


PROMPT = "streamrl> "
_COMMANDS = textwrap.dedent(__doc__.split("Commands (one per line)::")[1].split("Every command")[0]).strip("\n")
# each command with its arguments: the text before the description, on the lines that name one
_USAGES = [re.split(r"\s{2,}", ln)[0] for ln in _COMMANDS.splitlines() if ln and not ln[0].isspace()]


def usage(command: str) -> str:
    """The command with its arguments, from the module's command list."""
    return next((u for u in _USAGES if u.split(" ")[0] == command), command)


def _count(command: str, text: str) -> int:
    """A command's count argument: an int >= 1, else a ValueError naming the command."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{command}: expected a count >= 1, got {text!r}")
    return n


def _how_to_add() -> str:
    """How to give a job with no generation instance left another one."""
    from controller import dead_members

    dead = dead_members.known()
    if dead:  # a --join would be refused (it hung on the dead member)
        return (f"no process can join any more (rank(s) {sorted(dead)} died without leaving the RPC group): "
                "quit and restart the job from its checkpoint (--resume)")
    return "start a process with --join (docs/controller.md), then run again"
