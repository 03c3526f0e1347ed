"""Suite-wide fixtures."""
import logging
import signal

import pytest

# A test run started in the background by a non-interactive shell (`bash -c '... &'`, nohup)
# inherits SIGINT ignored: Python then installs no KeyboardInterrupt handler, and the processes
# the tests start inherit the ignore. The tests that deliver a Ctrl-C (tests/test_interrupt.py,
# test_engine_held_interrupt.py) need Python's own handler, which a terminal's run has: six of
# them failed in a README test command started so (session 57).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _streamrl_logging_restored():
    """``controller.main.main`` run in-process (config-error tests) sets up the ``streamrl``
    logger as a process does: a handler on the stderr of that moment (pytest's capture, closed
    after the test) and no propagation. Left in place, later tests' ``caplog`` saw nothing from
    ``streamrl.*`` and logging wrote to a closed file; each test gets the logger back as it was."""
    log = logging.getLogger("streamrl")
    saved = (list(log.handlers), log.propagate, log.level)
    yield
    log.handlers[:], log.propagate = saved[0], saved[1]
    log.setLevel(saved[2])


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """``controller.main.main`` run in-process also installs the run's handlers for SIGINT,
    SIGTERM and SIGHUP (``lifecycle.signals_interrupt``: the first signal ignores the others from
    then on). Left in place, a later test's SIGINT (tests/test_engine_held_interrupt.py) went to
    it: SIGTERM was ignored for every test after (session 52). Each test gets them back."""
    names = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    saved = [signal.getsignal(s) for s in names]
    yield
    for s, handler in zip(names, saved):
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)
