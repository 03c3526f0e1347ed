"""Settings a running program takes between iterations (the REPL's ``mode`` and ``dispatch``).

Each refuses what the run could not do with the setting in use kept: a mode of the other
placement, an async mode under ``trainer.max_staleness: 0``, a length-ordered dispatcher with no
ranker, a dispatcher whose plan fails on the live instances.
"""
from __future__ import annotations

from controller.config_checks import ConfigError, check_staleness
from controller.modes import get_mode
from controller.scheduling import ON_ESTIMATES, make_dispatcher, needs_ranker, runnable


def switch_mode(program, name: str) -> None:
    mode = get_mode(name)
    if mode.colocated != program.world.colocated:
        raise ValueError(f"pipeline.mode {name!r} needs a {'colocated' if mode.colocated else 'disaggregated'} "
                         "placement; this run's ranks are placed otherwise")
    try:  # an async mode with trainer.max_staleness 0 would skip every sample as stale
        check_staleness(name, program.cfg.trainer.max_staleness)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    program.mode = mode


def switch_dispatcher(program, name: str, **options) -> None:
    dispatcher = runnable(make_dispatcher(name, **options))
    why = needs_ranker(name, options)  # as config_checks / config_unused refuse it at load
    if why and program.ranker is None:
        what = f"dispatch {name}" if name in ON_ESTIMATES else "dispatch order=lpt"
        raise ValueError(f"{what} {why}; this run has no ranker (ranker.kind: none), so every request's "
                         "is max_tokens")
    trial_plan(program, dispatcher)
    program.world.sgs.dispatcher = dispatcher
    program.dispatch_name = name


def trial_plan(program, dispatcher) -> None:
    """A plan of one batch's requests (estimates spread over ``[1, max_tokens]``) on the live
    instances: a dispatcher whose plan() raises or cannot be run (``own_dispatcher.checked_plan``)
    is refused where it is set (the REPL's ``dispatch``: the one in use is kept), not found by
    the next round, which stops the run. One that fails only on other input still stops it."""
    sgs = program.world.sgs
    slots = list(sgs.slots)
    if not slots:
        return
    t = program.cfg.train
    n = t.batch_prompts * program.per_prompt
    est = [float(1 + (i * 7919) % t.max_tokens) for i in range(n)]
    try:
        dispatcher.plan(est, [s.profile for s in slots], seed=sgs.seed,
                        prompt_lens=[min(t.max_prompt_tokens or 64, 64)] * n)
    except Exception as e:  # noqa: BLE001 - the user's dispatcher (RunStopped: its checked plan)
        raise ValueError(f"a trial plan of {n} requests on the live instances ({len(slots)}) failed "
                         f"({type(e).__name__}: {e}); the dispatcher in use is kept") from None
