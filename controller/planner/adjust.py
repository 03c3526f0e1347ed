"""Dynamic adjustment of the generation service (paper section 4.2), as pure decisions.

The controller (``controller/session.Session``) calls ``ScaleOutPolicy.observe`` once
per iteration with the measured stage times and the iteration's workload; the policy says
whether to add one generation instance. delta = gen_time - train_time; delta' = the
generation time one more instance would save, predicted from the PTL profile and the
current workload (same dispatcher + instance model as the planner), and scaled to the
measured generation time (the profile gives the *relative* saving; the measurement the
absolute scale, so a profile that is off by a constant factor still decides right).
Add when delta >= delta' and a process is waiting to join; the session reports each add that
happened (``ScaleOutPolicy.added``), and the cooldown counts from it. The trainer is never
resized.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from controller.planner.allocation import generation_time_model
from controller.scheduling import PTLProfile

HISTORY = 256  # decisions kept (a run's every one grew with it; each is logged when made)


@dataclass
class ScaleDecision:
    """One iteration's verdict. ``wanted``: one more instance would pay (delta >= delta' > 0).
    ``add``: one is to be added at the next iteration boundary: wanted, not held back (cooldown,
    ``max_instances``) and a process is waiting to join; a wanted add with none waiting has
    ``add`` False and its ``reason`` says so. ``instances``: the count once the add is made."""
    iteration: int
    delta_s: float
    delta_prime_s: float
    add: bool
    instances: int
    reason: str
    wanted: bool = False


def predicted_gen_times(profile: PTLProfile, out_lens: Sequence[float], instances: Sequence[int],
                        prompt_lens: Sequence[int] | None = None, dispatcher: str = "oracle",
                        dispatch_kw: dict | None = None) -> list[float]:
    """Predicted generation time of this workload on each instance count, dispatched by
    ``dispatcher`` (its options ``dispatch_kw``)."""
    gt = generation_time_model(profile, [max(1, int(round(x))) for x in out_lens], prompt_lens, dispatcher,
                               **(dispatch_kw or {}))
    return [gt(k) for k in instances]


def lower_convex_hull(ts: Sequence[float]) -> list[float]:
    """Lower convex envelope of (k, ts[k-1]), k = 1..K, evaluated at every k. Dispatch and
    rounding make predicted times bumpy in k; the envelope keeps the diminishing returns
    (its differences never increase), so one bump cannot trigger or block an add."""
    pts: list[tuple[int, float]] = []
    for k, t in enumerate(ts, start=1):
        while len(pts) >= 2:
            (k1, t1), (k2, t2) = pts[-2], pts[-1]
            if (t2 - t1) * (k - k1) >= (t - t1) * (k2 - k1):  # pts[-1] is above the chord
                pts.pop()
            else:
                break
        pts.append((k, t))
    out = []
    for (k1, t1), (k2, t2) in zip(pts, pts[1:]):
        out += [t1 + (t2 - t1) * (k - k1) / (k2 - k1) for k in range(k1, k2)]
    return out + [pts[-1][1]]


def delta_prime(profile: PTLProfile, out_lens: Sequence[float], instances: int, gen_time_s: float | None = None,
                prompt_lens: Sequence[int] | None = None, dispatcher: str = "oracle", horizon: int = 0,
                dispatch_kw: dict | None = None) -> float:
    """Generation time saved by going from ``instances`` to ``instances + 1``: the drop of
    the convex envelope of the predicted times over 1..max(horizon, instances + 2)
    instances. With ``gen_time_s`` (measured) the predicted relative saving is applied to it."""
    k_max = max(horizon, instances + 2)
    ts = lower_convex_hull(predicted_gen_times(profile, out_lens, range(1, k_max + 1), prompt_lens, dispatcher,
                                               dispatch_kw))
    t_now, t_next = ts[instances - 1], ts[instances]
    saving = max(0.0, t_now - t_next)
    return saving if gen_time_s is None or t_now <= 0 else gen_time_s * saving / t_now


@dataclass
class ScaleOutPolicy:
    """Decides one add at a time. ``cooldown``: iterations to wait after an add that happened
    (``added``: the session reports each one; the new instance's effect shows in the iteration
    it joins at), counted from the iteration it joined at. ``max_instances`` bounds the service
    (0: no bound). ``dispatcher`` / ``dispatch_kw``: how the run dispatches (its ``dispatch``
    section), so delta' is the saving the run would see."""

    profile: PTLProfile
    dispatcher: str = "oracle"
    dispatch_kw: dict = field(default_factory=dict)
    cooldown: int = 1
    max_instances: int = 0
    horizon: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))  # the latest decisions
    _joined_at: int = -10**9

    def added(self, iteration: int) -> None:
        """An instance joined at the start of ``iteration`` (any add, a forced one too): the
        cooldown counts from here, not from a decision that found no process to add."""
        self._joined_at = iteration

    def observe(self, iteration: int, gen_time_s: float, train_time_s: float, out_lens: Sequence[float],
                instances: int, prompt_lens: Sequence[int] | None = None, spare: int | None = None) -> ScaleDecision:
        """out_lens: the iteration's output lengths (true, from finished samples). ``spare``:
        processes waiting to join (None: not known, taken as one waiting)."""
        delta = gen_time_s - train_time_s
        dp = delta_prime(self.profile, out_lens, instances, gen_time_s, prompt_lens, self.dispatcher, self.horizon,
                         self.dispatch_kw)
        wanted = delta >= dp > 0
        if self.max_instances and instances >= self.max_instances:
            add, why = False, f"at max_instances={self.max_instances}"
        elif iteration - self._joined_at < self.cooldown:
            add, why = False, f"cooldown after the add at iteration {self._joined_at}"
        elif wanted and spare == 0:
            add, why = False, (f"delta {delta:.3f}s >= delta' {dp:.3f}s: wanted an add, but no process is waiting "
                               "to join (start one with controller/main.py --join)")
        elif wanted:
            add, why = True, f"delta {delta:.3f}s >= delta' {dp:.3f}s"
        else:
            add, why = False, f"delta {delta:.3f}s < delta' {dp:.3f}s" if dp > 0 else "no predicted saving"
        d = ScaleDecision(iteration, delta, dp, add, instances + int(add), why, wanted)
        self.history.append(d)
        return d
