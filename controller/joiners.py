"""Processes that join a running job (``python controller/main.py --join``): the queue of those
waiting on the controller, their admission at an iteration boundary (run-time scale-out), and
telling one to leave. The session keeps the lists (``waiting``, ``joined``, ``departed``) and
the scale-out policy's latest wish (``want_add``)."""
from __future__ import annotations

import queue
import sys

import torch.distributed.rpc as rpc

from controller import keepalive
from controller.prompt_fit import ContextTooSmall
from controller.process_state import LOCAL, request_exit
from controller.rpc import WorkerFailed, worker_name
from controller.world import ModelMismatch, add_instance

_ANNOUNCED: "queue.Queue[tuple[int, str]]" = queue.Queue()  # (rank, role) of --join processes not yet taken
_WITHDRAWN: set[int] = set()  # joiners that left before they were added (Ctrl-C on their terminal)


def register_joiner(rank: int, role: str) -> bool:
    """RPC target: a process started with ``--join`` announces itself; it is added to the SGS
    at an iteration boundary when the scale-out policy (or a forced test flag) says so."""
    _ANNOUNCED.put((rank, role))
    keepalive.watch(rank)  # pinged from now on: it leaves if the controller goes silent
    print(f"[controller] rank {rank} ({role}) is waiting to join", file=sys.stderr, flush=True)
    return True


def withdraw_joiner(rank: int, why: str) -> bool:
    """RPC target: a joiner still waiting to be added leaves (stopped on its own terminal): it
    is no longer listed as waiting, pinged, or added (adding it found its process gone)."""
    _WITHDRAWN.add(rank)
    keepalive.unwatch(rank)
    print(f"[controller] rank {rank} left before it was added ({why})", file=sys.stderr, flush=True)
    return True


def still_waiting(ranks: list[int]) -> list[int]:
    """``ranks`` without those that withdrew or whose process the keepalive found gone (killed
    while waiting: it could not withdraw; adding it would meet its closed pipe)."""
    kept = []
    for r in ranks:
        if r in _WITHDRAWN:
            continue
        why = keepalive.lost(r)
        if why is None:
            kept.append(r)
            continue
        _WITHDRAWN.add(r)
        print(f"[controller] rank {r} was lost before it was added (its process is gone: {why})",
              file=sys.stderr, flush=True)
    return kept


def announced(timeout_s: float | None = None) -> list[int]:
    """The ranks announced since the last call and not withdrawn (with ``timeout_s``: wait that
    long for one when there is none yet; none came: [])."""
    ranks = []
    if timeout_s is not None:
        try:
            ranks.append(_ANNOUNCED.get(timeout=timeout_s)[0])
        except queue.Empty:
            return []
    while True:
        try:
            ranks.append(_ANNOUNCED.get_nowait()[0])
        except queue.Empty:
            return still_waiting(ranks)


def waiting(ranks: list[int]) -> list[int]:
    """The joiners that can still be added: ``ranks`` (those waiting so far) and the ones
    announced since, less those that withdrew or whose process is gone."""
    return still_waiting(ranks) + announced()


def leave_job(code: int, reason: str) -> bool:
    """RPC target on a process that joined with ``--join``: say why it leaves, on its own line,
    then exit with ``code`` the local way (it is none of torchrun's static ranks, so nobody's
    barrier waits for it). Its instance was closed first (``dismiss_joiner``)."""
    print(f"[join] rank {LOCAL.rank} exits (code {code}): {reason}", file=sys.stderr, flush=True)
    LOCAL.exit_reason = reason
    return request_exit(code, quiet=False)


def dismiss_joiner(rank: int, code: int, reason: str) -> None:
    """Tell joined process ``rank`` to exit with ``code``, giving ``reason`` (a joiner refused
    for its context, or one scaled in with the REPL's ``leave``); one already gone is skipped.
    It is no longer pinged (pings to its closed pipe logged an EPIPE each, after it left)."""
    keepalive.unwatch(rank)
    try:
        rpc.rpc_sync(worker_name(rank), leave_job, args=(code, reason), timeout=10)
    except Exception:  # noqa: BLE001 - already gone
        pass


def _dismiss_lost(session, rank: int, why: str) -> None:
    """A joiner found lost while being set up: gone, or alive past a deadline (its engine's start
    or its weight pull running long): told to exit, no longer pinged, so one alive does not
    hold its engine, unlisted, until the job ends (review, s53); one gone is skipped."""
    dismiss_joiner(rank, 1, f"not added: {why}")
    session.departed.append(rank)


def _cause(e: BaseException) -> str:
    """The last line of a raised worker's traceback (``ExcType: message``): its first line names
    only the call (a refused joiner was told "raised in __init__()" and not why; review, s54).
    torch RPC ends a remote error with an ``At:`` block naming its own frame: left out."""
    text, _, _ = str(e).strip().partition("\n\nAt:\n")
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1].strip()[:300] if len(lines) > 1 else ""


def admit(session, i: int) -> None:
    """Before iteration ``i``: take the announced processes into ``session.waiting`` and add
    the first of them as a generation instance when the scale-out policy wants one
    (``session.want_add``), ``placement.force_scale_out_at`` <= ``i``, or no instance is left. A joiner whose context
    is too small for the run's prompts is told to exit; one lost on the way is passed over."""
    placement = session.cfg.placement
    session.waiting = waiting(session.waiting)
    forced = 0 <= placement.force_scale_out_at <= i
    # (a joiner the policy added already, or one refused, counts as the one waited for: waiting
    # stalled the run max(rpc_timeout_s, 600) s; review, s54)
    came = session.waiting or session.joined or session.departed or _WITHDRAWN
    if forced and i == placement.force_scale_out_at and not came:
        # forced (tests, demos): wait for the joiner instead of racing its start-up, which
        # takes minutes on a loaded machine (importing torch, joining the RPC group); one that
        # came and left (withdrew, or its process is gone) is not waited for again
        wait_s = max(placement.rpc_timeout_s, 600.0)
        session.waiting += announced(timeout_s=wait_s)
        if not session.waiting:
            print(f"[controller] placement.force_scale_out_at={i}: no process joined within {wait_s:.0f} s; "
                  "going on without it", file=sys.stderr, flush=True)
    # (with no instance left, one waiting is added whatever the policy says: the run needs it)
    if not (session.waiting and (forced or session.want_add or not session.world.sgs.slots)):
        return
    rank = session.waiting.pop(0)
    session.joined.append(rank)
    session.want_add = False
    try:
        h = add_instance(session.world, session.cfg, rank, session.model_dir, session.eos_ids,
                         session.program.version)
    except ContextTooSmall as e:  # it would refuse kept prompts: the run goes on without it
        print(f"[controller] step {i}: {e}", file=sys.stderr, flush=True)
        dismiss_joiner(rank, 2, "not added: its max_model_len is less than this run's prompts need "
                                "(the controller's log says by how much)")
        session.departed.append(rank)
        return
    except ModelMismatch as e:  # its samples would be another model's: the run goes on without it
        print(f"[controller] step {i}: {e}; not added", file=sys.stderr, flush=True)
        dismiss_joiner(rank, 2, f"not added: {e}")
        session.departed.append(rank)
        return
    except WorkerFailed as e:  # the joiner lost, or raised while being set up (its engine, connect)
        if e.rank != rank:  # a trainer (a weight sender): the run's own failure
            raise
        first = str(e).splitlines()[0]
        if e.lost:
            print(f"[controller] step {i}: joiner rank {rank} lost before it was added: {first}",
                  file=sys.stderr, flush=True)
            _dismiss_lost(session, rank, first)
            return
        # nothing depended on it yet: the run goes on without it (it used to end the run)
        print(f"[controller] step {i}: joiner rank {rank} not added, it failed while being set up: "
              f"{str(e)}", file=sys.stderr, flush=True)
        dismiss_joiner(rank, 1, f"not added: it failed while being set up ({first} {_cause(e)})")
        session.departed.append(rank)
        return
    if h is None:  # lost before it held the weights (add_instance said so)
        _dismiss_lost(session, rank, "lost or timed out before it held the weights")
        return
    if session.policy is not None:
        session.policy.added(i)  # the cooldown counts from an add that happened
    print(f"[controller] step {i}: added generation instance rank {rank} "
          f"(weights v{session.program.version})", file=sys.stderr, flush=True)
