"""One attempt id for every rank of a torchrun (re)start.

torchrun's ``TORCHELASTIC_RESTART_COUNT`` is per node: only the agent whose worker failed
counts the restart; a node restarted because of a membership change keeps its count. So on
a multi-node job the new workers of one restart may see different counts, and torchrun's
store (shared, outliving attempts) still holds every dead attempt's keys. Per-attempt keys
are therefore named by an id the ranks agree on here, not by that counter:

* rank 0 makes a fresh random id N;
* every other rank r makes a fresh nonce n_r, sets ``streamrl/hello/{r}`` = n_r and polls
  ``streamrl/ack/{r}`` until it reads ``"{n_r}:{N}"``, then sets ``streamrl/ready/{r}`` = N;
* rank 0 answers each hello it sees (``ack/{r}`` = ``"{hello}:{N}"``) until every
  ``ready/{r}`` reads N.

Keys left by dead attempts carry other nonces / ids and are ignored (a stale hello gets an
ack nobody reads; a stale ready holds another id). A rank that never says hello within the
timeout makes rank 0 raise one line naming it; a rank that hears no ack raises too.
"""
from __future__ import annotations

import os
import time
import uuid

_ATTEMPT: str | None = None  # this process's agreed id (one process = one attempt)
_STARTS: int | None = None  # rank 0: the attempts of this job so far, this one included (STARTS_KEY)
STARTS_KEY = "streamrl/starts"  # counted by rank 0 once per attempt: the store outlives attempts
# the current id, set once the controller is up (a joiner reads it; a change: the job restarted)
ATTEMPT_KEY = "streamrl/attempt"


def store_key(name: str, attempt: str) -> str:
    """The key (or PrefixStore prefix) ``name`` of ``attempt`` in torchrun's store: every
    per-attempt key (config agreement, process group, RPC store address, joiners) is named here."""
    return f"streamrl/{attempt}/{name}"


class AttemptError(RuntimeError):
    """The ranks did not agree on an attempt id within the timeout."""


def peek(store, key: str) -> str | None:
    """The key's value, or None when it is not set (no blocking get)."""
    if not store.check([key]):
        return None
    return store.get(key).decode()


def agree_on_attempt(store, rank: int, world: int, timeout_s: float, poll_s: float = 0.05) -> str:
    """Run the handshake over ``store`` (torchrun's TCPStore); every rank returns the same fresh id."""
    deadline = time.monotonic() + timeout_s
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"streamrl/hello/{rank}", nonce)
        while True:
            ack = peek(store, f"streamrl/ack/{rank}")
            if ack is not None and ack.startswith(nonce + ":"):
                attempt = ack[len(nonce) + 1:]
                store.set(f"streamrl/ready/{rank}", attempt)
                return attempt
            if time.monotonic() >= deadline:
                raise AttemptError(f"rank {rank}: rank 0 did not answer the attempt handshake in torchrun's store "
                                   f"within {timeout_s:g} s")
            time.sleep(poll_s)
    attempt = uuid.uuid4().hex
    pending = set(range(1, world))
    acked: dict[int, str] = {}  # the hello each pending rank was last answered for
    while pending:
        for r in sorted(pending):
            if peek(store, f"streamrl/ready/{r}") == attempt:
                pending.discard(r)
                continue
            hello = peek(store, f"streamrl/hello/{r}")
            if hello is not None and acked.get(r) != hello:  # a new hello (a stale one is answered too: harmless)
                store.set(f"streamrl/ack/{r}", f"{hello}:{attempt}")
                acked[r] = hello
        if not pending:
            break
        if time.monotonic() >= deadline:
            missing = sorted(pending)
            raise AttemptError(f"attempt handshake: rank(s) {missing} of {world} never said hello in torchrun's "
                               f"store within {timeout_s:g} s (their node did not start or rejoin?)")
        time.sleep(poll_s)
    return attempt


def torchrun_store(timeout_s: float):
    """A client of torchrun's store (MASTER_ADDR:MASTER_PORT), waiting up to ``timeout_s``."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def current_attempt(timeout_s: float) -> str:
    """This process's attempt id under torchrun: agreed once (torchrun's store, ranks RANK /
    WORLD_SIZE), then the same answer."""
    global _ATTEMPT, _STARTS
    if _ATTEMPT is None:
        store, rank = torchrun_store(timeout_s), int(os.environ["RANK"])
        _ATTEMPT = agree_on_attempt(store, rank, int(os.environ["WORLD_SIZE"]), timeout_s)
        if rank == 0:
            _STARTS = count_start(store)
    return _ATTEMPT


def count_start(store) -> int:
    """Count one more attempt of the job whose store this is; returns the count (1: the first)."""
    return int(store.add(STARTS_KEY, 1))


def is_restart() -> bool:
    """Whether this attempt restarts the torchrun job (after any node's failure or a membership
    change). On rank 0 once the attempt is agreed: the job's count in torchrun's store; else
    ``TORCHELASTIC_RESTART_COUNT`` > 0, which only the node whose worker failed raises."""
    if _STARTS is not None:
        return _STARTS > 1
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
