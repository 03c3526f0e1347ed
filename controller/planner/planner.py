"""Cluster planning: cluster + model + workloads -> stage models -> allocation -> per-mode
simulation (``Planner``). Algorithm 1 plans on every simulated iteration's batch (each stage
at its mean time over them), the batches the plan's simulation then runs; each pipeline mode's
recommended allocation minimises its own objective (``OBJECTIVES``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from controller.planner.allocation import (Allocation, StageModel, allocate_cross_dc, allocate_single_dc,
                                           even_split, mean_generation_time_model, most_trainer_splits)
from controller.planner.cluster import Cluster
from controller.planner.hardware import (ModelSpec, analytic_ptl_profile, analytic_train_profile, gpu,
                                         tp_candidates, tp_problem, trainer_min_gpus)
from controller.planner.simulator import MODES, SimConfig, simulate, sync_time_s
from controller.planner.workloads import Workloads
from controller.scheduling import PTLProfile
from workers.trainer.config_names import WHITENED, trains_at_step

PROGRESS_MIN = 128  # instance counts x batches from which planning shows progress on stderr (~30 s)

SYNC_CANDIDATES = 8  # splits simulated per synchronous mode: the best by gen + sync + train (stage model)
# What each mode's recommended allocation minimises (Planner.recommend, docs/planner.md Allocation)
OBJECTIVES = {
    m: "every GPU of the datacenter generates, then trains: no split to choose" if mode.colocated else
    ("the stages overlap, the slower one sets the iteration: the shorter simulated iteration of Algorithm 1's "
     "max(gen, train) and its max(gen, train + sync) (a step starts after the last push ends)") if mode.lag else
    ("this mode's simulated iteration time (training waits for generation: gen + sync + train), the "
     "shortest of the splits simulated (Planner.sync_candidates)")
    for m, mode in MODES.items()
}


@dataclass
class Plan:
    """Allocation + per-mode simulated iteration time, throughput and cost."""

    allocation: Allocation
    gen_gpu: str
    train_gpu: str
    price_per_s: float
    modes: dict[str, dict] = field(default_factory=dict)
    tp: int = 1  # GPUs per generation instance
    colocated: bool = False  # every GPU generates then trains (allocation.gen_gpus: all of them)


@dataclass
class TPOption:
    """One generation tensor-parallel size the planner tried: its instance profile, stage
    model and Algorithm 1 allocation; ``problem`` says why it cannot run the workload."""

    tp: int
    profile: PTLProfile | None = None
    stage_model: StageModel | None = None
    allocation: Allocation | None = None
    problem: str = ""

    def key(self) -> tuple:
        """Best first: shortest iteration, then fewest GPUs (Algorithm 1's own rule), then the
        smaller tp (more instances)."""
        a = self.allocation
        return (a.iteration_s, a.gen_gpus + a.train_gpus, self.tp)

    def summary(self) -> dict:
        if self.allocation is None:
            return {"tp": self.tp, "skipped": self.problem}
        a = self.allocation
        return {"tp": self.tp, "iteration_s": round(a.iteration_s, 2), "gen_s": round(a.gen_time_s, 2),
                "train_s": round(a.train_time_s, 2), "gen_gpus": a.gen_gpus, "instances": a.gen_instances,
                "train_gpus": a.train_gpus}


@dataclass
class Planner:
    cluster: Cluster
    model: ModelSpec
    workloads: Workloads
    algorithm: str = "ppo"
    dispatcher: str = "skew_paper"
    # whitened advantages (trainer.whiten_advantages; None: on for ppo and REINFORCE++, as the
    # trainer's default and verl's) make every mode train at the end of its iteration (SimConfig.train_at_end)
    whiten: bool | None = None
    # a reference model to hold and run (trainer.kl_coef > 0); without one, verl's and the
    # trainer's runs neither load nor run it (docs/trainer.md)
    reference: bool = True
    # trainer.filter_groups / trainer.rollout_is_batch_normalize: training waits for the
    # iteration's last sample (trains_at_step; the filter's refill batches are not simulated)
    filter_groups: bool = False
    is_batch_normalize: bool = False

    def __post_init__(self):
        if self.whiten is None:
            self.whiten = self.algorithm in WHITENED
        elif self.whiten and self.algorithm not in WHITENED:
            raise ValueError(f"whiten: advantage whitening is PPO's (GAE) and REINFORCE++'s; {self.algorithm} "
                             "normalises per group")
        # the trainer's forward/backward wait for the iteration's last sample (the trainer's rule)
        self.train_at_end = trains_at_step(self.algorithm, self.whiten, self.filter_groups, self.is_batch_normalize)
        self.g_gen = gpu(self.cluster.dc("generation").gpu)
        self.g_train = gpu(self.cluster.dc("trainer").gpu)
        unit = self.cluster.trainer_unit
        self.train_min = math.ceil(trainer_min_gpus(self.model, self.g_train, self.algorithm,
                                                        reference=self.reference) / unit) * unit
        self.tp_options = [self._option(tp) for tp in self._tps()]
        ok = [o for o in self.tp_options if o.allocation is not None]
        if not ok:
            raise ValueError(self._none_fits())
        best = min(ok, key=TPOption.key)
        self.tp, self.gen_profile, self.stage_model = best.tp, best.profile, best.stage_model

    def _train_profile(self, gpus: int):
        """The trainer's roofline profile on ``gpus`` training GPUs (``analytic_train_profile``)."""
        return analytic_train_profile(self.model, self.g_train, gpus, self.algorithm, reference=self.reference)

    @property
    def tp_fixed(self) -> bool:
        return self.cluster.gen_tp is not None

    def _where(self) -> str:
        return f"cluster {self.cluster.name!r}, model {self.model.name!r}"

    def _tps(self) -> list[int]:
        """The cluster's ``gen_tp`` (checked against the model) or the candidates to search."""
        node = self.cluster.gpus_per_node
        if self.tp_fixed:
            problem = tp_problem(self.model, self.g_gen, self.cluster.gen_tp, node)
            if problem:
                raise ValueError(f"{self._where()}: gen_tp: {problem}")
            return [self.cluster.gen_tp]
        tps = tp_candidates(self.model, self.g_gen, node)
        if not tps:
            raise ValueError(f"{self._where()}: no generation instance fits one node of {node} x {self.g_gen.name} "
                             f"(gpus_per_node): {tp_problem(self.model, self.g_gen, node, node)}")
        return tps

    def _none_fits(self) -> str:
        """Why no tp tried can run the workload: the smallest whose samples fit (too few GPUs: it
        needs the fewest), else the largest that holds the model's heads (it has the most KV room),
        else the heads."""
        fits = [o for o in self.tp_options if o.stage_model is not None]
        if fits:
            return fits[0].problem
        built = [o for o in self.tp_options if o.profile is not None]
        if built:
            return built[-1].problem
        return f"{self._where()}: no generation tp up to gpus_per_node fits: {self.tp_options[-1].problem}"

    def _option(self, tp: int) -> TPOption:
        """``tp``'s instance profile, stage model and allocation, or the problem that stops it."""
        problem = tp_problem(self.model, self.g_gen, tp, self.cluster.gpus_per_node)
        if problem:
            return TPOption(tp, problem=problem)
        prof = analytic_ptl_profile(self.model, self.g_gen, tp)
        too_long = [o + q for it in self.workloads.iterations for o, q in zip(it.out_lens, it.prompt_lens)
                    if prof.seq_kv_tokens(o + q) > prof.kv_tokens]  # every simulated iteration must fit
        if too_long:
            return TPOption(tp, prof, problem=(
                f"{len(too_long)} samples (up to {max(too_long)} tokens with the prompt) do not fit one instance's "
                f"KV cache ({prof.kv_tokens} tokens on {tp} x {self.g_gen.name}); lower --max-len"))
        # Algorithm 1 plans on every simulated iteration's batch (the ones the plan's simulation then
        # runs and reports), each stage at its mean time over them, not on the first draw alone
        gen_time = mean_generation_time_model(prof, [(w.out_lens, w.prompt_lens) for w in self.workloads.iterations],
                                              self.dispatcher)
        tokens = self.workloads.tokens  # training is affine in tokens: its mean time is its time on the mean
        sm = StageModel(
            gen_time, lambda y: self._train_profile(y).time(tokens),
            gen_unit=math.lcm(tp, self.cluster.gen_unit),  # whole instances per unit
            train_unit=self.cluster.trainer_unit, train_min=self.train_min, gpus_per_instance=tp)
        self._precompute(sm, tp)
        try:
            return TPOption(tp, prof, sm, self._allocate(sm, even=False))
        except ValueError as e:
            return TPOption(tp, prof, sm, problem=f"{self._where()}: {e}")

    def _precompute(self, sm: StageModel, tp: int) -> None:
        """Generation time of every instance count Algorithm 1 will ask for (cached in ``sm``),
        with a progress bar on stderr when there are many (a 2,048-GPU plan takes minutes)."""
        if self.cluster.cross_dc:
            top = self.cluster.dc("generation").gpus
        else:
            top = self.cluster.datacenters[0].gpus - self.train_min
        xs = range(sm.gen_unit, top + 1, sm.gen_unit)
        work = len(xs) * len(self.workloads.iterations)
        if work < PROGRESS_MIN:
            return
        from rich.console import Console
        from rich.progress import track

        for x in track(xs, description=f"planner: tp {tp}, generation time per instance count",
                       console=Console(stderr=True)):
            sm.gen(x)

    def allocate(self, even: bool = False) -> Allocation:
        try:
            return self._allocate(self.stage_model, even)
        except ValueError as e:
            raise ValueError(f"{self._where()}: {e}") from None

    def _allocate(self, sm: StageModel, even: bool) -> Allocation:
        if self.cluster.cross_dc:
            if even:
                raise ValueError("even split is a single-datacenter baseline")
            return allocate_cross_dc(sm, self.cluster.dc("generation").gpus, self.cluster.dc("trainer").gpus)
        n = self.cluster.datacenters[0].gpus
        return even_split(sm, n) if even else allocate_single_dc(sm, n)

    def even_split(self) -> tuple[Allocation | None, str | None]:
        """The even-split baseline's allocation, or (None, why it cannot run here: half the GPUs
        do not hold the trainer, where Algorithm 1 gives it more)."""
        try:
            return self.allocate(even=True), None
        except ValueError as e:
            return None, str(e)

    def sync_s(self) -> float:
        gbps = self.cluster.link_gbps if self.cluster.cross_dc else self.cluster.intra_gbps
        return sync_time_s(self.model.weight_bytes, gbps)

    def price_per_s(self, a: Allocation) -> float:
        pg = self.cluster.dc("generation").price_per_gpu_hour
        pt = self.cluster.dc("trainer").price_per_gpu_hour
        return (a.gen_gpus * pg + a.train_gpus * pt) / 3600.0

    def recommend(self, modes=MODES) -> dict[str, Plan]:
        """Each mode's recommended allocation, simulated (a Plan holding that mode), chosen by the
        mode's own objective (OBJECTIVES): the async modes overlap the stages, so theirs is the
        faster simulated of Algorithm 1's max(gen, train) and max(gen, train + sync)
        (``async_candidates``); batch / minibatch / stream pay gen + sync + train (training waits
        for generation, the next generation for the sync), so their split is the one of shortest
        simulated iteration among ``sync_candidates``; colocated uses every GPU for both stages."""
        out, cands = {}, None
        for mode in modes:
            if mode == "colocated":
                if self.cluster.cross_dc:
                    continue
                n = self.cluster.datacenters[0].gpus
                a = Allocation(n, 0, n // self.tp, math.nan, math.nan)
                out[mode] = self.simulate_modes(a, [mode])
                out[mode].colocated = True
            else:
                if MODES[mode].lag:
                    plans = [self.simulate_modes(a, [mode]) for a in self.async_candidates()]
                else:
                    cands = cands if cands is not None else self.sync_candidates()
                    plans = [self.simulate_modes(a, [mode], o) for o, a in cands]
                out[mode] = min(plans, key=lambda p: (p.modes[mode]["iteration_s"],
                                                      p.allocation.gen_gpus + p.allocation.train_gpus, p.tp))
        return out

    def async_candidates(self) -> list[Allocation]:
        """The splits the one-step-off modes simulate: Algorithm 1's (the paper's max(gen, train))
        and Algorithm 1 on a trainer that also pays the weight sync, max(gen, train + sync). A step
        starts only after the push of the step before it has ended (the runtime's rule since session
        50), so a trainer holding every sample to its step (PPO whitening, gpg, async_batch) has a
        period of train + sync: on a slow cross-DC link Algorithm 1 gave back trainer GPUs that
        shortened the iteration by a third (review, s54)."""
        first, sync = self.allocate(), self.sync_s()
        if sync <= 0:
            return [first]
        sm = self.stage_model
        paying = replace(sm, train_time=lambda y: sm.train_time(y) + sync)
        try:
            second = self._allocate(paying, False)
        except ValueError as e:
            raise ValueError(f"{self._where()}: {e}") from None
        second = replace(second, train_time_s=sm.train(second.train_gpus))
        same = (second.gen_gpus, second.train_gpus) == (first.gen_gpus, first.train_gpus)
        return [first] if same else [first, second]

    def sync_candidates(self) -> list[tuple[TPOption, Allocation]]:
        """The splits the synchronous modes simulate: for every tp tried, every generation size
        with the trainer on the GPUs left (``most_trainer_splits``), ranked by the stage model's
        gen + sync + train (their iteration without overlap); the ``SYNC_CANDIDATES`` best, plus
        Algorithm 1's allocation and the even split (so the choice is never slower than either
        in the simulation). Bounded so a large cluster (hundreds of sizes) simulates a few."""
        best = next(o for o in self.tp_options if o.tp == self.tp)
        sync, cross = self.sync_s(), self.cluster.cross_dc
        splits = []
        for o in self.tp_options:
            if o.allocation is None:
                continue
            if cross:
                splits += [(o, a) for a in most_trainer_splits(o.stage_model, self.cluster.dc("trainer").gpus,
                                                               self.cluster.dc("generation").gpus)]
            else:
                splits += [(o, a) for a in most_trainer_splits(o.stage_model, self.cluster.datacenters[0].gpus)]
        splits.sort(key=lambda s: (s[1].gen_time_s + sync + s[1].train_time_s, s[1].gen_gpus + s[1].train_gpus,
                                   s[0].tp))
        chosen = splits[:SYNC_CANDIDATES] + [(best, self.allocate())]
        even = None if cross else self.even_split()[0]
        if even is not None:  # a baseline, where the trainer fits half
            chosen.append((best, even))
        out, seen = [], set()
        for o, a in chosen:
            if (o.tp, a.gen_gpus, a.train_gpus) not in seen:
                seen.add((o.tp, a.gen_gpus, a.train_gpus))
                out.append((o, a))
        return out

    def simulate_modes(self, a: Allocation, modes=MODES, option: TPOption | None = None) -> Plan:
        """Simulate allocation ``a`` in each of ``modes``, with the chosen tp's instances (or
        ``option``'s, one of ``tp_options``)."""
        tp, profile = (option.tp, option.profile) if option is not None else (self.tp, self.gen_profile)
        plan = Plan(a, self.g_gen.name, self.g_train.name, self.price_per_s(a), tp=tp)
        batch = sum(self.workloads.iterations[0].trains)  # the samples that train (not remax's greedy ones)
        for mode in modes:
            if mode == "colocated" and self.cluster.cross_dc:
                continue
            if mode == "colocated":  # every GPU does both stages, one after the other
                n = a.gen_gpus + a.train_gpus
                k, trainer, sync = n // tp, self._train_profile(n), 0.0
            else:
                k, trainer, sync = a.gen_instances, self._train_profile(a.train_gpus), self.sync_s()
            cfg = SimConfig(mode, k, profile, trainer, sync_s=sync, dispatcher=self.dispatcher,
                            minibatch_size=max(1, batch // 8), microbatch_tokens=0, train_at_end=self.train_at_end)
            r = simulate(cfg, self.workloads.iterations)
            it = r.steady_iteration_s()
            per_dollar = round(batch / (it * plan.price_per_s), 2) if plan.price_per_s > 0 else None  # free GPUs
            plan.modes[mode] = {"iteration_s": round(it, 2), "samples_per_s": round(batch / it, 3),
                                "samples_per_dollar": per_dollar}
        return plan


def describe(p: Plan) -> dict:
    a = p.allocation
    if p.colocated:
        return {"gen": f"{a.gen_gpus} x {p.gen_gpu} ({a.gen_instances} instances)", "gen_tp": p.tp,
                "train": f"the same {a.gen_gpus} x {p.train_gpu}, after generation", "released": [0, 0],
                "dollars_per_hour": round(p.price_per_s * 3600, 1), "modes": p.modes}
    return {"gen": f"{a.gen_gpus} x {p.gen_gpu} ({a.gen_instances} instances)", "gen_tp": p.tp,
            "train": f"{a.train_gpus} x {p.train_gpu}", "released": [a.released_gen, a.released_train],
            "gen_s": round(a.gen_time_s, 2), "train_s": round(a.train_time_s, 2),
            "dollars_per_hour": round(p.price_per_s * 3600, 1), "modes": p.modes}


def describe_mode(p: Plan, mode: str) -> dict:
    """One mode's recommendation: what it minimises, its allocation, its simulated numbers."""
    d = describe(p)
    out = {"objective": OBJECTIVES[mode], **{k: v for k, v in d.items() if k != "modes"}, **d["modes"][mode]}
    if out["iteration_s"] < max(out.get("gen_s", 0.0), out.get("train_s", 0.0)):
        out["note"] = ("gen_s and train_s are the allocation model's mean stage times over every batch; "
                       "iteration_s is the simulator's steady state (warm-up iterations left out, stages "
                       "overlapping), so it can be below them")
    return out
