"""``held_interrupt()``: Ctrl-C held off while an engine changes its bookkeeping (admission, the
tokens a step appends, finishing), raised when that is done. A ``KeyboardInterrupt`` landing
between two of those changes left a sequence finished in none of its structures: past its
``max_tokens``, holding blocks in the queue, or a group prompt's pin never marked ready (its
siblings waited forever). The forward stays interruptible: a step that fails there puts its
batch back (``NativeEngine._requeue``)."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def held_interrupt():
    """On the main thread under Python's own SIGINT handler (a notebook, a script): a SIGINT that
    arrives inside the block is raised as ``KeyboardInterrupt`` once the block has run. Elsewhere
    (an RPC thread, where no signal arrives; a handler someone else installed) nothing changes."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    got: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if got:
        raise KeyboardInterrupt
