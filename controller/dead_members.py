"""Processes that died inside the job's dynamic RPC group, and the joiners they turn away.

A process that leaves the group the graceful way (the REPL's ``leave``, Ctrl-C or SIGTERM on a
joiner) is taken off every member's list before it exits. One killed (SIGKILL, a crash, the OOM
killer) stays listed, and torch's RPC has no way to drop it: each later joiner's start calls
every listed member, meets the dead one's closed port, and hangs there for its whole
``--rpc-timeout`` holding the group's join token, so that no process joins or leaves the graceful
way after it. The controller therefore says in torchrun's store which member it found dead
(``note``, from the keepalive's ping and from a round's call), and a later ``--join`` refuses in
one line (``refusal``) instead of hanging: the job goes on with the instances it has; to add
processes again, restart it from its checkpoint.
"""
from __future__ import annotations

import sys
import threading

import torch.distributed.rpc as rpc

from controller.attempt import current_attempt, peek, store_key, torchrun_store
from controller.rpc import worker_name

_DEAD: dict[int, str] = {}  # rank -> why it was found gone (on the controller)
_LOCK = threading.Lock()
STORE_S = 10.0  # the longest the controller waits on torchrun's store to say it


def _listed(rank: int) -> bool:
    """Whether ``rank`` is still a member of this process's RPC group (a graceful leave took it off)."""
    try:  # (torch keeps the agent private; get_worker_infos lists the group's members now)
        return worker_name(rank) in {w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos()}
    except RuntimeError:  # no RPC agent (anymore): nothing to say
        return False


def note(rank: int, why: str) -> bool:
    """``rank``'s process was found gone (``why``: the transport's error). If it is still listed
    in the RPC group, it died there: said once on stderr and in torchrun's store (for joiners).
    True when it was noted now."""
    with _LOCK:
        if rank in _DEAD or not _listed(rank):
            return False
        _DEAD[rank] = why
    print(f"[controller] rank {rank} died without leaving the RPC group ({why}): torch's RPC cannot drop it, so "
          "no process can join this job any more (a --join is refused); to add generation processes again, "
          "restart the job from its checkpoint", file=sys.stderr, flush=True)
    try:
        torchrun_store(STORE_S).set(store_key("dead_member", current_attempt(STORE_S)), f"{rank}: {why}")
    except Exception as e:  # noqa: BLE001 - no torchrun store (a test's in-process group): joiners can't come
        print(f"[controller] could not note rank {rank}'s death in torchrun's store ({type(e).__name__}: {e}); "
              "a --join may hang on it", file=sys.stderr, flush=True)
    return True


def known() -> dict[int, str]:
    """The ranks this controller found dead in the RPC group, with why."""
    with _LOCK:
        return dict(_DEAD)


def refusal(store, attempt: str, address: str) -> str | None:
    """On a joiner, before it joins the RPC group: why it must not (a member died there), or None."""
    said = peek(store, store_key("dead_member", attempt))
    if said is None:
        return None
    rank, _, why = said.partition(": ")
    return (f"[join] the job at {address} takes no more joiners: rank {rank}, a process that joined it, died "
            f"without leaving its RPC group ({why}), and torch's RPC cannot drop a dead member: joining would "
            "hang on it. The job goes on with the instances it has; to add generation processes, restart it "
            "from its checkpoint (--resume) and join the new attempt")
