"""``RunStopped``: the controller decided the run cannot usefully go on (every worker still
answers, so the job leaves in lock-step, quietly; raised by a REPL ``run``, it ends the session too:
the pipeline stopped mid-iteration)."""
from __future__ import annotations


class RunStopped(RuntimeError):
    """The run cannot usefully go on (e.g. an iteration trained nothing); the message says why."""
