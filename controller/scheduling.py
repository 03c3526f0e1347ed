"""Skewness-aware dispatching (paper Algorithm 2) and LPT admission order.

A dispatcher splits one generate call's requests over the generation instances and fixes,
per instance, the admission order and a batch-size cap. Dispatchers live in a registry
(``DISPATCHERS``); ``make_dispatcher(name, **kw)`` builds one:

* ``random``      shuffle, cut into N equal chunks, FCFS order (today's practice)
* ``round_robin`` request i -> instance i mod N, FCFS order
* ``skew``        Algorithm 2 on the ranker's estimates, LPT order; splits scored by the
                  event-level instance model over several long-tail fractions
* ``skew_paper``  Algorithm 2 literally: alpha = 20%, cost PTL(BS) * L_avg * ceil(M / BS)
* ``oracle``      ``skew`` fed the true lengths (upper bound of what a ranker can give)

The per-instance cost models (``controller/dispatch_cost.py``: the paper's
``PTL(BS) * L_avg * ceil(M / BS)``, or the simulated instance); see docs/scheduling.md for every
choice they make.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from controller.dispatch_cost import COSTS, free_cap
from controller.length_estimates import BinnedPosterior, calibrate_by_bins, calibrate_by_rank  # noqa: F401 (re-exported)
from controller.ptl_profile import PTLProfile  # noqa: F401 (re-exported)
from workers.generation.request_check import is_int, is_real


@dataclass
class DispatchPlan:
    """per_instance[i]: request indices for instance i, in admission order.
    batch_caps[i]: the max batch size instance i should run with. ``long_tail[i]`` marks
    instances dedicated to the long-tail class; ``predicted_s[i]`` the cost model's time."""

    per_instance: list[list[int]]
    batch_caps: list[int]
    kind: str
    long_tail: list[bool] = field(default_factory=list)
    predicted_s: list[float] = field(default_factory=list)


class Dispatcher(Protocol):
    def plan(self, est_lens: Sequence[float], profiles: list[PTLProfile], true_lens: Sequence[float] | None = None,
             seed: int = 0, prompt_lens: Sequence[float] | None = None) -> DispatchPlan: ...


def lpt_order(idx: Sequence[int], lens: Sequence[float]) -> list[int]:
    """Longest-processing-time first: indices by decreasing length, ties by index."""
    return sorted(idx, key=lambda i: (-lens[i], i))


def lpt_schedule(durations: Sequence[float], machines: int) -> float:
    """Makespan of LPT list scheduling on ``machines`` identical machines (P||Cmax): jobs in
    decreasing duration, each to the machine that frees first. Each batch slot of an
    engine is such a machine when its KV budget is the only limit."""
    free = [0.0] * machines
    for d in sorted(durations, reverse=True):
        j = int(np.argmin(free))
        free[j] += d
    return max(free) if free else 0.0


def _check(est_lens: Sequence[float], profiles: list[PTLProfile], true_lens) -> None:
    if not profiles:
        raise ValueError("dispatch: no generation instances (profiles is empty)")
    for name, xs in (("est_lens", est_lens), ("true_lens", true_lens)):
        if xs is None:
            continue
        if len(xs) != len(est_lens):
            raise ValueError(f"dispatch: {name} has {len(xs)} entries, est_lens {len(est_lens)}")
        bad = [i for i, x in enumerate(xs) if not (x >= 0) or math.isinf(x)]
        if bad:
            raise ValueError(f"dispatch: {name}[{bad[0]}] = {xs[bad[0]]} is not a finite length >= 0")


@dataclass
class _ChunkDispatcher:
    """Assign by a fixed rule (random chunks or round robin), then order FCFS or LPT."""

    kind: str
    assign: Callable[[int, int, int], list[list[int]]]
    order: str = "fcfs"

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"dispatcher order {self.order!r} is not one of {sorted(ORDERS)}")

    def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None) -> DispatchPlan:
        _check(est_lens, profiles, true_lens)
        groups = self.assign(len(est_lens), len(profiles), seed)
        per = [ORDERS[self.order](g, est_lens) for g in groups]
        caps = [free_cap(p, len(g)) for p, g in zip(profiles, per)]
        return DispatchPlan(per, caps, self.kind, [False] * len(per))


def _random_chunks(m: int, n: int, seed: int) -> list[list[int]]:
    perm = np.random.default_rng(seed).permutation(m)
    return [sorted(int(i) for i in c) for c in np.array_split(perm, n)]


def _round_robin(m: int, n: int, seed: int) -> list[list[int]]:
    return [list(range(j, m, n)) for j in range(n)]


ORDERS: dict[str, Callable[[Sequence[int], Sequence[float]], list[int]]] = {
    "fcfs": lambda idx, lens: sorted(idx),
    "lpt": lpt_order,
}


def spread_evenly(idx: Sequence[int], lens: Sequence[float], n: int) -> list[list[int]]:
    """Longest first, each to the instance with the least estimated work so far (then fewest
    requests, then lowest index): balances both the work and the count of a class."""
    groups: list[list[int]] = [[] for _ in range(n)]
    heap = [(0.0, 0, k) for k in range(n)]  # (work, count, instance)
    for i in lpt_order(idx, lens):
        work, count, j = heapq.heappop(heap)
        groups[j].append(i)
        heapq.heappush(heap, (work + lens[i], count + 1, j))
    return groups


@dataclass
class SkewDispatcher:
    """Paper Algorithm 2, extended. For each alpha in ``alphas`` the longest ceil(alpha*M)
    estimates form the long-tail class; for each N_l in 1..N-1 the long-tail class is
    spread over N_l instances and the rest over N - N_l; each instance's time comes from
    the cost model ``cost`` and the (alpha, N_l) with the smallest maximum wins.

    cost="formula" is the paper's PTL(BS) * L_avg * ceil(M / BS), L_avg = q_long (long-tail
    instances) / q_regular (regular) quantile of the class's estimates (``quantile_of=
    "class"``) or of the whole distribution D (``"distribution"``, the paper's wording);
    BS = what the KV cache holds at that length; the plan's batch cap is that BS.
    cost="simulate" runs the event-level instance model on the estimates instead (batch
    capped by memory only). The class defaults are the paper-literal ones
    (``make_dispatcher("skew_paper")``); ``make_dispatcher("skew")`` uses SKEW_DEFAULTS.
    ``use_true``: plan on the true lengths (the oracle). ``noise``: how wrong the estimates
    are: a log-error std, or a ``BinnedPosterior`` of held-out (estimate, true) pairs; the
    simulate cost then averages over draws of the true lengths, which steers away from
    splits that only win when the ranker is right.
    ``mixed``: also consider N_l = 0 (no dedicated long-tail instances; every request spread
    evenly by estimated work), the fallback when separation does not pay; its instances admit
    in ``mixed_order`` when set (else ``order``/``orders``): when the estimates do not support
    dedicated instances, LPT on them admits the long samples they miss last.
    ``orders``: more admission orders each instance may take if its cost says faster;
    ``draws``: noise draws per instance cost."""

    alphas: tuple[float, ...] = (0.2,)
    cost: str = "formula"
    q_long: float = 0.9
    q_regular: float = 0.5
    quantile_of: str = "distribution"
    order: str = "lpt"
    use_true: bool = False
    kind: str = "skew"
    noise: "float | BinnedPosterior" = 0.0
    mixed: bool = False
    orders: tuple[str, ...] = ()
    draws: int = 4
    mixed_order: str | None = None

    def __post_init__(self):
        for key in ("alphas", "orders"):  # a YAML scalar where a list goes (``alphas: 0.2``)
            if isinstance(getattr(self, key), (str, bytes, int, float)):
                raise ValueError(f"skew dispatcher: {key} must be a list (e.g. {key}: "
                                 f"{[0.1, 0.2] if key == 'alphas' else ['lpt']}), got {getattr(self, key)!r}")
        try:
            self.alphas = tuple(float(a) for a in self.alphas)
        except (TypeError, ValueError):
            raise ValueError(f"skew dispatcher: alphas must be a list of fractions in (0, 1), "
                             f"got {self.alphas!r}") from None
        if not self.alphas or any(not 0.0 < a < 1.0 for a in self.alphas):
            raise ValueError(f"skew dispatcher: every alpha must be in (0, 1), got {self.alphas}")
        if self.cost not in COSTS:
            raise ValueError(f"skew dispatcher: cost {self.cost!r} is not one of {sorted(COSTS)}")
        if self.quantile_of not in ("class", "distribution"):
            raise ValueError(f"skew dispatcher: quantile_of must be 'class' or 'distribution', got {self.quantile_of!r}")
        if isinstance(self.orders, Mapping):
            raise ValueError(f"skew dispatcher: orders must be a list of order names, got {self.orders!r}")
        self.orders = tuple(self.orders)
        if self.mixed_order == "":
            raise ValueError("skew dispatcher: mixed_order must be an order name or null, got ''")
        for o in (self.order, *self.orders, *([self.mixed_order] if self.mixed_order is not None else [])):
            if o not in ORDERS:
                raise ValueError(f"skew dispatcher: order {o!r} is not one of {sorted(ORDERS)}")
        for key in ("mixed", "use_true"):
            if not isinstance(getattr(self, key), bool):  # "false" is truthy
                raise ValueError(f"skew dispatcher: {key} must be true or false, got {getattr(self, key)!r}")
        for key in ("q_long", "q_regular"):
            v = getattr(self, key)
            if not (is_real(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"skew dispatcher: {key} must be a quantile in [0, 1], got {v!r}")
        if not (is_int(self.draws) and self.draws >= 1):
            raise ValueError(f"skew dispatcher: draws must be an int >= 1, got {self.draws!r}")
        if not isinstance(self.noise, BinnedPosterior) and not (is_real(self.noise) and self.noise >= 0):
            raise ValueError(f"skew dispatcher: noise must be a finite log-error std >= 0, got {self.noise!r}")

    def unread(self) -> dict[str, str]:
        """The options this one never reads -> what would read them: ``make_dispatcher`` refuses
        one set to other than the dispatcher's default (accepted, it gave the default plan; review, s53)."""
        simulate = "cost: simulate (the event-level model)"
        if self.cost == "formula":
            out = dict.fromkeys(("mixed", "noise", "orders", "draws"), simulate)
        else:
            out = dict.fromkeys(("q_long", "q_regular", "quantile_of"), "cost: formula (its L_avg)")
            if self.use_true:  # the oracle plans on the true lengths: no noise to draw
                out.update(dict.fromkeys(("noise", "draws"), "estimates (not the oracle's true lengths)"))
            elif not isinstance(self.noise, BinnedPosterior) and self.noise == 0:
                out["draws"] = "noise > 0 (the draws of the true lengths)"
        if not (self.mixed and self.cost == "simulate"):
            out["mixed_order"] = "mixed: true and cost: simulate"
        return out

    def split_costs(self, lens: Sequence[float], profiles: list[PTLProfile], prompt_len: float = 0.0
                    ) -> dict[tuple[float, int], tuple[float, list[list[int]], list[float], list[int]]]:
        """(alpha, N_l) -> (max latency, groups, per-instance latency, per-instance batch cap),
        groups[:N_l] being the long-tail instances, each group in its admission order (with
        ``orders``, the fastest of ``order`` and ``orders`` by the cost model). N_l = 0 (key (alphas[0], 0); with
        ``mixed`` or when N == 1): no dedicated instances, all requests spread evenly."""
        m, n = len(lens), len(profiles)
        order = lpt_order(range(m), lens)
        arr = np.asarray(lens, dtype=float)
        out = {}
        for alpha in (self.alphas[:1] if n == 1 else self.alphas):
            # rounded before the ceil: in floats 0.07 * 100 is 7.000000000000001 (a class of 8); the
            # float error, ~1e-16 of alpha * m, stays far below the 1e-9 rounding for m up to ~1e6
            n_long = min(m, max(1, math.ceil(round(alpha * m, 9)))) if m else 0
            long_idx, reg_idx = order[:n_long], order[n_long:]

            def l_avg(idx: list[int], q: float) -> float:
                src = arr[idx] if self.quantile_of == "class" else arr
                return float(np.quantile(src, q)) if len(idx) else 0.0

            # the formula has no term for a long sample among short ones: mixed needs "simulate"
            mixed = n == 1 or (self.mixed and self.cost == "simulate" and alpha == self.alphas[0])
            for n_l in range(0 if mixed else 1, n):
                if n_l == 0:  # no dedicated long-tail instances: everything spread evenly
                    groups, classes, q = spread_evenly(order, lens, n), [order] * n, [self.q_regular] * n
                else:
                    groups = spread_evenly(long_idx, lens, n_l) + spread_evenly(reg_idx, lens, n - n_l)
                    classes = [long_idx] * n_l + [reg_idx] * (n - n_l)
                    q = [self.q_long] * n_l + [self.q_regular] * (n - n_l)
                lat, caps, ordered = [], [], []
                noise = 0.0 if self.use_true or self.cost != "simulate" else self.noise
                # each instance: the admission order (and, in the cost, the cap) it runs fastest with
                tries = dict.fromkeys((self.order, *self.orders)) if self.cost == "simulate" else [self.order]
                if n_l == 0 and n > 1 and self.mixed_order:  # the fallback: estimates not trusted for order
                    tries = [self.mixed_order]
                for j, g in enumerate(groups):
                    best = None if g else (0.0, 1, [])  # an instance with nothing to do (many at large N)
                    for o in (tries if g else ()):
                        idx = ORDERS[o](g, lens)
                        t, cap = COSTS[self.cost](profiles[j], arr[idx], l_avg(classes[j], q[j]), prompt_len, noise,
                                                 self.draws)
                        if best is None or t < best[0]:
                            best = (t, cap, idx)
                    lat.append(best[0])
                    caps.append(best[1])
                    ordered.append(best[2])
                out[(alpha, n_l)] = (max(lat), ordered, lat, caps)
        return out

    def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None) -> DispatchPlan:
        _check(est_lens, profiles, true_lens)
        if self.use_true and true_lens is None:
            raise ValueError("oracle dispatcher needs true_lens")
        lens = list(true_lens if self.use_true else est_lens)
        prompt_len = float(np.mean(prompt_lens)) if prompt_lens is not None and len(prompt_lens) else 0.0
        costs = self.split_costs(lens, profiles, prompt_len)
        key = min(costs, key=lambda k: (costs[k][0], k[1], k[0]))
        _, per, lat, caps = costs[key]
        return DispatchPlan(per, [max(1, c) for c in caps], self.kind,
                            [j < key[1] for j in range(len(per))], lat)


# The default "skew": Algorithm 2's enumeration, scored by the event-level instance model
# and over a few long-tail fractions; "skew_paper" is the literal formula with alpha = 0.2.
# On estimates the long-tail class stays >= 10% (a tiny class is fragile: the long samples
# the ranker misses land on the crowded instances); the oracle may also try 2% and 5%.
# Both may also keep every instance mixed when separating does not pay (mixed=True).
# In the mixed fallback `skew` admits FCFS: over 7 sampled workloads of the trace (instance
# model, lgbm ranker) mixed + FCFS beat mixed + LPT every time (by 1-8%); see docs/scheduling.md.
SKEW_DEFAULTS = dict(cost="simulate", alphas=(0.1, 0.2, 0.3), mixed=True, mixed_order="fcfs")
ORACLE_DEFAULTS = dict(cost="simulate", alphas=(0.02, 0.05, 0.1, 0.2, 0.3), mixed=True)

DISPATCHERS: dict[str, Callable[..., Dispatcher]] = {
    "random": lambda order="fcfs": _ChunkDispatcher("random", _random_chunks, order),
    "round_robin": lambda order="fcfs": _ChunkDispatcher("round_robin", _round_robin, order),
    "skew": lambda **kw: SkewDispatcher(**{**SKEW_DEFAULTS, **kw}),
    "skew_paper": lambda **kw: SkewDispatcher(kind="skew_paper", **kw),
    "oracle": lambda **kw: SkewDispatcher(use_true=True, kind="oracle", **{**ORACLE_DEFAULTS, **kw}),
}
# The options (``dispatch.options``) each dispatcher takes; ``kind`` and ``use_true`` are fixed
# by the name (``oracle`` is ``skew`` on the true lengths).
_SKEW_OPTIONS = tuple(f.name for f in fields(SkewDispatcher) if f.name not in ("kind", "use_true"))
DISPATCHER_OPTIONS: dict[str, tuple[str, ...]] = {
    "random": ("order",),
    "round_robin": ("order",),
    "skew": _SKEW_OPTIONS,
    "skew_paper": _SKEW_OPTIONS,
    "oracle": _SKEW_OPTIONS,
}


ON_ESTIMATES = ("skew", "skew_paper")  # dispatchers that split a batch by its length estimates


def needs_ranker(name: str, options: Mapping | None = None) -> str:
    """Why dispatcher ``name`` with ``options`` acts on a ranker's output-length estimates
    (without one every request's is max_tokens), or '': the one rule the config checks, the
    unused-key checks and the REPL's ``dispatch`` apply."""
    if name in ON_ESTIMATES:
        return "dispatches on output-length estimates"
    if dict(options or {}).get("order") == "lpt":
        return "orders by output-length estimate"
    return ""


def runnable(d: Dispatcher) -> Dispatcher:
    """``d``, if a training run can use it: the oracle plans on the true output lengths, which
    only a benchmark knows (bench/skew_dispatch.py); a run has only the ranker's estimates."""
    if getattr(d, "use_true", False):
        raise ValueError("the oracle dispatcher plans on the true output lengths, which a training run does not "
                         "know (it is for bench/skew_dispatch.py); use skew, skew_paper, random or round_robin")
    return d


def make_dispatcher(name: str, **kwargs) -> Dispatcher:
    """Build a dispatcher by registry name; kwargs go to its constructor (e.g. order="lpt",
    alphas=(0.2,)). An option the dispatcher does not take is a ValueError naming the
    dispatcher and the options it takes. ``name`` may also be the user's own class or factory,
    ``package.module:Name`` / ``path/to/file.py:Name`` (as ``task.name``), whose ``plan`` is
    checked on every call (``checked_plan``)."""
    from workers.tasks.plugins import is_plugin

    if name not in DISPATCHERS and is_plugin(name):
        from controller.own_dispatcher import own_dispatcher

        return own_dispatcher(name, **kwargs)
    if name not in DISPATCHERS:
        raise ValueError(f"dispatcher {name!r} is not one of {sorted(DISPATCHERS)}, nor module:Name of your own")
    takes = DISPATCHER_OPTIONS.get(name)
    unknown = sorted(k for k in kwargs if takes is not None and k not in takes)
    if unknown:
        import difflib

        near = [m for k in unknown for m in difflib.get_close_matches(str(k), takes, n=1, cutoff=0.75)]
        raise ValueError(f"dispatcher {name!r} takes {_options_text(takes)}, got {unknown}"
                         + (f"; did you mean {near[0]!r}?" if near else ""))
    d = DISPATCHERS[name](**kwargs)
    if isinstance(d, SkewDispatcher):
        # set to a value of its own: neither the dispatcher's default (skew's mixed: true) nor the
        # class's (off: mixed false, noise 0), which change nothing where it is not read
        own = DISPATCHERS[name]()
        field_default = {f.name: f.default for f in fields(SkewDispatcher)}
        unread = [(k, why) for k, why in d.unread().items()
                  if k in kwargs and getattr(d, k) not in (getattr(own, k), field_default[k])]
        if unread:
            key, needs = unread[0]
            has = f"cost {d.cost!r}" + (f", mixed {str(d.mixed).lower()}" if key == "mixed_order" else "")
            raise ValueError(f"dispatcher {name!r}: {key} is read only with {needs}, and this one has {has}; "
                             f"drop {key}")
    return d


def _options_text(takes: tuple[str, ...]) -> str:
    if not takes:
        return "no options"
    if len(takes) == 1:
        return f"only {takes[0]!r}"
    return "the options " + ", ".join(takes)
