"""The controller's run on rank 0, start to exit: run the ``Session`` (set up, the program or
the REPL, log, checkpoint), then stop every worker -- cleanly on success, at once on a failure.

The run ends by printing one JSON line on stdout: reward_first / reward_last (mean reward of
the first / last 10% of iterations), samples_per_s, iterations, logdir (+ a few more). The
session itself is ``controller.session``.
"""
from __future__ import annotations

import json
import sys
import traceback

import torch.distributed.rpc as rpc

from controller import checkpoint as ckpt
from controller import lifecycle
from controller.config import ConfigError
from controller.config_notes import config_notes
from controller.config_overrides import set_behind
from controller.joiners import dismiss_joiner, waiting as joiners_waiting
from controller.process_state import LOCAL, request_exit
from controller.rpc import WorkerFailed, gone_peers, worker_name
from controller.session import Session, error_line
from controller.sgs import NoInstancesLeft
from controller.stops import RunStopped


def _stop_workers(ranks: list[int], code: int, quiet: bool | None = None) -> None:
    """Tell ``ranks`` to exit with ``code``. ``quiet`` (default: ``code == 0`` and no rank that
    joined later): the static ranks leave RPC in lock-step (controller.processes.stop_processes);
    a joined process, or an instance lost during the run, would leave RRef owners the
    lock-step exit waits for, so those runs exit the local way."""
    import torch.distributed as dist

    if quiet is None:
        static = dist.get_world_size() if dist.is_initialized() else 1
        quiet = code == 0 and all(r < static for r in ranks)
    LOCAL.quiet_exit = quiet  # the controller's own exit takes the same path
    futs = []
    for r in ranks:
        try:
            futs.append(rpc.rpc_async(worker_name(r), request_exit, args=(code, quiet), timeout=10))
        except Exception:  # noqa: BLE001 - already gone
            pass
    for f in futs:
        try:
            f.wait()
        except Exception:  # noqa: BLE001
            pass


def run_controller(cfg, args, world_size: int) -> int:
    """Returns the process exit code (0 ok, 1 a worker or the controller failed)."""
    static = list(range(1, world_size))
    session = None
    alive = True  # every worker still answers (the run ended by the controller's own decision)
    for note in config_notes(cfg):
        print(f"[controller] {note}", file=sys.stderr, flush=True)

    def said(code: int) -> int:
        """The run's end is said (with a stopped run's resume hint): a stop signal from here on
        (torchrun stops every rank once one has died) keeps ``code``, with no second line
        (``controller.main._interrupted``); it landed in the logs' close below, and a lost
        worker's exit 1 became "stopped by SIGTERM", exit 130 (review, s53)."""
        if code == 1 and session is not None:
            print(f"[controller] {ckpt.resume_hint(session.logdir, args.resume)}", file=sys.stderr, flush=True)
        LOCAL.outcome = code
        return code

    try:
        session = Session(cfg, args, world_size)
        summary = session.run()
        print(json.dumps(summary), flush=True)
        code = said(0)
    except ConfigError as e:  # found by the controller before any work (e.g. the logdir)
        behind = set_behind(getattr(args, "set", None), str(e))  # named as typed, as at load
        print(f"config error: {behind + ': ' if behind else ''}{e}", file=sys.stderr, flush=True)
        code = said(2)
    except (WorkerFailed, RunStopped, NoInstancesLeft, OSError) as e:  # OSError: the run folder (full, gone)
        sig = lifecycle.stop_signal()
        if sig and isinstance(e, (WorkerFailed, NoInstancesLeft)):
            # a worker lost to the job's own Ctrl-C / SIGTERM, seen before this process's interrupt
            # surfaced: the run was stopped by the signal, and says so (controller.main._interrupted)
            raise lifecycle.interrupt_for(sig) from None
        gone = _gone_peers(session, e)
        print(f"[controller] run stopped: {'; '.join(gone) + ', and ' if gone else ''}"
              f"{error_line(e) if isinstance(e, OSError) else e}", file=sys.stderr, flush=True)
        code = said(1)
        alive = isinstance(e, (RunStopped, OSError))  # the controller's decision, not a lost worker
    except Exception:  # noqa: BLE001 - the controller itself failed
        print(f"[controller] run stopped by a controller error:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code, alive = said(1), False  # it may have failed in the middle of a call to a worker
    finally:  # also on Ctrl-C / SIGTERM, which pass through: the timeline of every span logged
        if session is not None:
            try:  # a tracker's run (wandb) ends failed unless the run succeeded (then run() closed it)
                session.metrics.close(exit_code=1 if sys.exc_info()[0] is not None or code != 0 else 0)
            except OSError as e:  # the run folder went bad (full, read-only): said once already
                print(f"[controller] closing the logs: {e}", file=sys.stderr, flush=True)
    waiting = joiners_waiting(session.waiting if session else [])
    joined = session.joined if session else []
    # (an instance that left on request, a REPL leave or a scale-in, is a live process: its
    # rank's RRefs are answered, so it does not keep the static ranks from the quiet exit)
    lost = bool(session and session.world.sgs.lost)
    gone = set(session.departed) if session else set()  # exited already: nothing to tell them
    for r in waiting:  # registered, never added: say so on the joiner's own terminal
        dismiss_joiner(r, code, "the job ended before the scale-out policy added it")
    _stop_workers(static + [r for r in joined if r not in gone], code,
                  quiet=alive and not joined and not waiting and not lost)
    return code


def _gone_peers(session, e: BaseException) -> list[str]:
    """A worker that raised (e.g. EOF from a peer it was calling): the other workers whose process
    is gone, said first, as the likely cause (``rpc.gone_peers``)."""
    world = getattr(session, "world", None)
    if world is None or not isinstance(e, WorkerFailed) or e.lost:
        return []
    handles = [h for h in list(world.trainers) + list(world.sgs.handles) if h.alive]
    try:
        return gone_peers(handles, e.rank)
    except Exception:  # noqa: BLE001 - a probe that fails says nothing
        return []
