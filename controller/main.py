"""StreamRL entry point: one program for every rank.

Single machine (controller + 1 generation instance + 1 trainer rank)::

    torchrun --nproc-per-node 3 controller/main.py --config configs/quickstart.yaml

Options: ``--repl`` (interactive console on the controller), ``--resume DIR`` (run logdir or
checkpoint), ``--set key=value`` (config override, repeatable, e.g. ``--set train.iterations=5``).

Two nodes (rank 0 = controller on node 0; torchrun's c10d rendezvous, nothing home-made)::

    # on each node (NODE0 = address of node 0)
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint NODE0:29400 \
        controller/main.py --config configs/cluster_2node.yaml

Add a generation instance to a running job (elastic scale-out; ADDR = the job's store,
printed by the controller at start as ``join address``)::

    python controller/main.py --join ADDR --role generation

Rank 0 is the controller (``controller/runner.py``); every other rank serves RPC and hosts
the role objects the controller creates on it (``GenerationInstance``, ``TrainerRank``).
Data-plane collectives (trainer DP group, weight sync) use gloo on CPU, NCCL on GPU (each
worker takes LOCAL_RANK's GPU). RPC runs in dynamic-membership mode (``world_size=None``,
required of every rank so that processes can join later).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # torchrun runs this file as a script

if "TORCHELASTIC_RUN_ID" in os.environ and "--join" not in sys.argv:  # a torchrun rank: before torch's
    import signal

    from controller.lifecycle import die_with_launcher  # seconds-long import, an orphan window

    def _leave_at_start(*_):  # stopped before any work: the exit code only (it was a traceback from
        os._exit(130)  # every rank's `import torch`)

    die_with_launcher()
    for _s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(_s) is not signal.SIG_IGN:  # (`torchrun ... &` from a script: SIGINT ignored)
            signal.signal(_s, _leave_at_start)

from workers.heap import limit_arenas  # noqa: E402

limit_arenas()  # before torch starts its threads: a trainer's heap grew ~6 MB per step without it

import torch  # noqa: E402

from controller.processes import run_rank  # noqa: E402
from controller.process_state import LOCAL, RPC_TIMEOUT_S  # noqa: E402
from controller.rpc import MAX_RPC_TIMEOUT_S  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="StreamRL controller / worker entry point",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", help="YAML run config (configs/*.yaml)")
    ap.add_argument("--repl", action="store_true", help="interactive console on the controller (stdin of rank 0)")
    ap.add_argument("--resume", default="", help="run logdir or checkpoint folder to resume from")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--join", default="", metavar="HOST:PORT", help="join a running job's RPC group")
    ap.add_argument("--role", default="generation", choices=["generation"], help="role of a joining process")
    ap.add_argument("--rpc-timeout", type=float, default=None,
                    help="RPC timeout of a joining process (s; default 300; a torchrun rank's: "
                         "placement.rpc_timeout_s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = ap.parse_args(argv)
    if not args.join and not args.config:
        ap.error("--config is required (unless --join)")
    if args.join:
        host, sep, port = args.join.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            ap.error(f"--join must be HOST:PORT (the controller's 'join address' line), got {args.join!r}")
        given = [flag for flag, on in (("--config", args.config), ("--set", args.set), ("--repl", args.repl),
                                       ("--resume", args.resume)) if on]
        if given:  # they would be dropped without a word
            ap.error(f"--join takes the running job's config; {', '.join(given)} cannot be given with it")
    elif args.rpc_timeout is not None:  # a torchrun rank's is the config's: it was dropped without a word
        ap.error(f"--rpc-timeout is a joining process's (with --join); a run's is placement.rpc_timeout_s: "
                 f"--set placement.rpc_timeout_s={args.rpc_timeout:g}")
    if args.rpc_timeout is None:
        args.rpc_timeout = 300.0
    if args.threads < 1:
        ap.error(f"--threads must be >= 1 (torch threads per process), got {args.threads}")
    if not (math.isfinite(args.rpc_timeout) and 0 < args.rpc_timeout <= MAX_RPC_TIMEOUT_S):
        ap.error(f"--rpc-timeout must be a number of seconds in (0, {MAX_RPC_TIMEOUT_S}] (torch RPC keeps "
                 f"milliseconds in 32 bits), got {args.rpc_timeout}")
    return args


def _log_to_stderr() -> None:
    """StreamRL's own loggers (``streamrl.*``: SFT progress, trainer and engine warnings) print
    on stderr as ``[streamrl.sft] ...``; other libraries' loggers keep their own settings."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    root = logging.getLogger("streamrl")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    _log_to_stderr()
    if args.join:
        import signal

        from controller import lifecycle
        from controller.join_cli import join_main

        lifecycle.signals_interrupt(signal.SIGTERM, signal.SIGHUP)  # one line, as Ctrl-C (join_cli._interrupted)
        try:
            return join_main(args)
        except KeyboardInterrupt as e:  # before it registered: nothing to tell anyone
            print(f"[join] stopped by {str(e) or 'SIGINT'} before it joined", file=sys.stderr, flush=True)
            os._exit(130)
    if "RANK" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit("controller/main.py must be launched with torchrun "
                 "(torchrun --nproc-per-node 3 controller/main.py --config configs/quickstart.yaml)")
    import signal

    from controller import lifecycle
    from controller.attempt import AttemptError
    from controller.config import ConfigError, load_config
    from controller.config_overrides import set_behind
    from controller.config_unused import minibatch_unused
    from controller.run_record import plain

    lifecycle.die_with_launcher()  # (again: main() may be called without the module's start)
    if getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "_leave_at_start":  # Ctrl-C is ours now
        signal.signal(signal.SIGINT, signal.default_int_handler)
    lifecycle.signals_interrupt(signal.SIGTERM, signal.SIGHUP)
    world = int(os.environ["WORLD_SIZE"])
    cfg, error = None, ""
    try:
        try:  # every rank validates, so a bad config stops all of them before any work
            loaded = load_config(args.config, world, args.set)  # the --set texts: an error echoes them as typed
            try:
                if args.repl and loaded.train.eval_only:
                    raise ConfigError("train.eval_only evaluates and stops, --repl opens a console: give one of "
                                      "them (the console's `eval N` evaluates the weights it holds)")
                if not args.repl:  # (a console may switch to `mode minibatch`, which reads it)
                    minibatch_unused(loaded)
            except ConfigError as e:  # named as load_config's are: the --set behind it, else the file
                raise ConfigError(f"{set_behind(args.set, str(e)) or args.config}: {e}") from None
            cfg = loaded
        except ConfigError as e:
            error = str(e)
        error = lifecycle.agree_on_config(int(os.environ["RANK"]), world, None if cfg is None else plain(cfg),
                                          error, cfg.placement.rpc_timeout_s if cfg is not None else RPC_TIMEOUT_S)
    except KeyboardInterrupt:  # stopped before any work: nothing to say but the exit code
        os._exit(130)
    except AttemptError as e:  # the ranks of this attempt did not all meet in torchrun's store
        print(f"[rank {os.environ['RANK']}] {e}", file=sys.stderr, flush=True)
        return 1
    if error is not None:  # said already, once per node (lifecycle.agree_on_config)
        return 2

    def controller() -> int:
        from controller.runner import run_controller

        return run_controller(cfg, args, world)

    try:
        return run_rank(controller, cfg.placement.rpc_timeout_s, cfg.placement.elastic)
    except KeyboardInterrupt as e:
        _interrupted(cfg.logging.logdir, args.resume, str(e))


def _interrupted(logdir: str, resume: str, signame: str = "") -> None:
    """Ctrl-C (every rank of the terminal's job gets SIGINT), SIGTERM or SIGHUP: one line from
    rank 0 saying what is kept, no traceback from every rank, and out at once (RPC threads may
    still be blocked in calls to peers that are going away). Checkpoints are written
    atomically, so the last complete one is intact whatever was running. On the controller,
    after the run's end was said (``LOCAL.outcome``: a lost worker, a success), the signal is
    torchrun stopping the job's ranks: the exit code said stands, with no second line."""
    from controller.lifecycle import leave_now

    if LOCAL.outcome is not None:
        leave_now(LOCAL.outcome)
    if os.environ.get("RANK") == "0":
        from controller.checkpoint import resume_hint
        from controller.preflight import run_logdir

        folder = LOCAL.run_folder or run_logdir(Path(logdir), resume)  # resolved by the session once it began
        how = "stopped by " + signame if signame else "interrupted"
        if signame == "SIGTERM":  # torchrun stops the ranks so when one of them exits: this one cannot tell
            from controller.keepalive import lost_ranks  # which (every rank is signalled at once), unless a

            gone = {r: why for r, why in lost_ranks().items()  # keepalive ping found one gone before (a
                    if r < int(os.environ.get("WORLD_SIZE", "0"))}  # joiner's loss the run survived: not it)
            how += (f" (worker rank {min(gone)} was lost before: {gone[min(gone)]})" if gone else
                    " (yours, or torchrun's after a rank exited: its report names that rank)")
        print(f"[controller] {how}; {resume_hint(folder, resume)}", file=sys.stderr, flush=True)
    leave_now(130)  # an engine's own process (vLLM's engine core) is stopped first


if __name__ == "__main__":
    sys.exit(main())
