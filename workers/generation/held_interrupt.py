"""``HeldInterrupt``: Ctrl-C held off while an engine changes its bookkeeping (admission, the
tokens a step appends, finishing), raised when that is done. A ``KeyboardInterrupt`` landing
between two of those changes left a sequence finished in none of its structures: past its
``max_tokens``, holding blocks in the queue, or a group prompt's pin never marked ready (its
siblings waited forever). The forward stays interruptible (``interruptible()``): a step that
fails there puts its batch back (``NativeEngine._requeue``)."""
from __future__ import annotations

import signal
import threading


class HeldInterrupt:
    """``with HeldInterrupt() as held:`` on the main thread under Python's own SIGINT handler (a
    notebook, a script): a SIGINT inside the block is raised as ``KeyboardInterrupt`` when the
    block ends, or at once inside ``held.interruptible()``'s part (one held before it is raised
    on entering it). Elsewhere (an RPC thread, where no signal arrives; a handler someone else
    installed) nothing changes. One handler swap a block: an engine holds one per step
    (~10 us measured on a 2-core VM, of a ~2.5 ms step at workload (a))."""

    __slots__ = ("active", "pending", "open")

    def __enter__(self) -> "HeldInterrupt":
        self.pending = self.open = False
        self.active = (threading.current_thread() is threading.main_thread()
                       and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self.active:
            signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        if self.open:
            raise KeyboardInterrupt
        self.pending = True

    def interruptible(self) -> "_Open":
        """The part a Ctrl-C interrupts at once (the forward); a held one is raised on entry."""
        return _Open(self)

    def __exit__(self, *exc) -> None:
        if self.active:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if self.pending and exc[0] is None:
                raise KeyboardInterrupt


class _Open:
    __slots__ = ("held",)

    def __init__(self, held: HeldInterrupt):
        self.held = held

    def __enter__(self) -> None:
        h = self.held
        if h.pending:
            h.pending = False
            raise KeyboardInterrupt
        h.open = True

    def __exit__(self, *exc) -> None:
        self.held.open = False
