"""Suite-wide fixtures."""
import logging

import pytest


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
