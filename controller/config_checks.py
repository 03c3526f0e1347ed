"""The checks of a run config across keys, run once its sections are built: placement
against the world, the pipeline mode against the trainer's staleness, sampling against the
algorithm, and the names that select registered implementations (task, dispatcher, ranker)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from controller.config_unused import check_unused
from controller.config_types import ConfigError
from controller.modes import MODES
from workers.types import GREEDY_BELOW, SAMPLE_STRIDE, SERVED_TEMPERATURES, temperature_served

if TYPE_CHECKING:
    from controller.config import Config, RankerSection


def validate(cfg: Config, world_size: int | None = None) -> None:
    p, t = cfg.placement, cfg.train
    for role in ("generation", "trainer"):
        ranks = getattr(p, role)
        if not ranks:
            raise ConfigError(f"placement.{role}: needs at least one rank")
        for i, r in enumerate(ranks):
            if not isinstance(r, int) or isinstance(r, bool) or r < 1:
                raise ConfigError(f"placement.{role}[{i}]: {r!r} is not a worker rank (ints >= 1; "
                                  "rank 0 is the controller)")
            if world_size is not None and r >= world_size:
                raise ConfigError(f"placement.{role}[{i}]: rank {r} >= world size {world_size} "
                                  f"(launch with --nproc-per-node/--nnodes giving >= {cfg.world_ranks})")
        if len(set(ranks)) != len(ranks):
            raise ConfigError(f"placement.{role}: duplicate ranks {ranks}")
    if world_size is not None and hasattr(cfg.topology, "check_world"):
        try:
            cfg.topology.check_world(world_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if t.sft_steps and cfg.model.init is None:
        # the SFT warm-start is part of building a model (model.init); on a model folder it never ran
        raise ConfigError(f"train.sft_steps: {t.sft_steps} SFT steps run only when model.init builds the model "
                          "(a tiny model trained from scratch); model.path's folder is used as it is: drop "
                          "train.sft_steps (verl's SFT trainer is a run of its own)")
    if cfg.engine.eos_ids is not None:
        # make_engine's override for library use; a run's engines and trainer ranks both stop on
        # the model folder's ids, so the key was accepted and then ignored
        raise ConfigError("engine.eos_ids: a run stops on its model folder's ids (the tokenizer's EOS and the "
                          "eos_token_id of config.json and generation_config.json), for generation and the "
                          "trainer's min_tokens masking alike; list yours in the folder's generation_config.json "
                          "and leave engine.eos_ids out")
    if p.colocated and cfg.pipeline.mode != "colocated":
        # a colocated world with another mode overlapped generation and training in one process
        # on one-step-old weights, and the REPL's `mode` refused the run's own mode
        raise ConfigError(f"placement.colocated: true time-shares the ranks, which is pipeline.mode: colocated, "
                          f"not {cfg.pipeline.mode!r}; set pipeline.mode: colocated (it implies "
                          "placement.colocated), or give generation and training their own ranks")
    colocated = cfg.pipeline.mode == "colocated" or p.colocated
    if colocated and sorted(p.generation) != sorted(p.trainer):
        same = list(range(1, len(p.trainer) + 1))
        raise ConfigError(f"placement: colocated needs generation == trainer ranks, got {p.generation} vs "
                          f"{p.trainer}; generation and training take turns on the same ranks: e.g. "
                          f"placement.generation={same} placement.trainer={same} ({len(same) + 1} processes)")
    if not colocated and set(p.generation) & set(p.trainer):
        # placement.colocated alone is refused in any other mode (above): the advice names the mode
        g, n = len(p.generation), len(p.generation) + len(p.trainer)
        raise ConfigError(f"placement: ranks {sorted(set(p.generation) & set(p.trainer))} are in both "
                          f"generation and trainer; give each its own ranks (e.g. placement.generation="
                          f"{list(range(1, g + 1))} placement.trainer={list(range(g + 1, n + 1))}, {n + 1} processes), "
                          "or time-share equal lists with pipeline.mode: colocated (it implies placement.colocated)")
    if t.batch_prompts < len(p.trainer):  # groups go to trainer ranks by group id: one would get none
        raise ConfigError(f"train.batch_prompts: {t.batch_prompts} prompts an iteration cannot feed the "
                          f"{len(p.trainer)} trainer ranks of placement.trainer {p.trainer} (each rank trains "
                          f"whole prompt groups: one would get none and sit idle every iteration); "
                          f"set train.batch_prompts >= {len(p.trainer)}")
    for key in ("temperature", "eval_temperature"):  # the gap no engine serves (the fields' Ranges bound the rest)
        if not temperature_served(getattr(t, key)):
            raise ConfigError(f"train.{key} must be {SERVED_TEMPERATURES}, got {getattr(t, key)!r}")
    if t.min_tokens > t.max_tokens:
        raise ConfigError(f"train.min_tokens must be <= train.max_tokens ({t.max_tokens}), got {t.min_tokens}")
    if t.length_trace and not Path(t.length_trace).is_file():
        raise ConfigError(f"train.length_trace: {t.length_trace} does not exist (a length trace, "
                          "e.g. data/length_traces/llama33_70b_rg_easy.val.jsonl.gz)")
    check_staleness(cfg.pipeline.mode, getattr(cfg.trainer, "max_staleness", None))
    algorithm = getattr(cfg.trainer, "algorithm", None)
    grouped = getattr(cfg.trainer, "grouped", False)
    if grouped and t.temperature < GREEDY_BELOW:
        raise ConfigError(f"train.temperature: {algorithm} with greedy sampling ({t.temperature}) draws the same "
                          f"sample {'as the greedy baseline' if algorithm == 'remax' else 'group_size times'}, so "
                          "every group's advantages are 0 and nothing trains; sample at a temperature > 0")
    if t.eval_samples > 1 and t.eval_temperature < GREEDY_BELOW:
        raise ConfigError(f"train.eval_samples: {t.eval_samples} greedy samples of a prompt are all the same; "
                          "set train.eval_temperature > 0")
    if grouped and algorithm != "remax" and t.group_size < 2:  # remax compares with its greedy baseline
        raise ConfigError(f"train.group_size: {algorithm} needs >= 2 samples per prompt (its advantages "
                          f"compare a sample with its group's others), got {t.group_size}")
    _check_kl_horizon(cfg)
    _check_group_filter(cfg)
    _check_sample_ids(cfg)
    _check_registries(cfg)
    _check_multi_turn(cfg)
    check_unused(cfg)
    if world_size is not None and world_size < 2:
        raise ConfigError(f"world size {world_size}: needs a controller and at least one worker rank")
    listed = {*p.generation, *p.trainer}
    idle = [r for r in range(1, cfg.world_ranks) if r not in listed]
    if idle:  # launched (the world holds every listed rank) and given nothing to do
        raise ConfigError(f"placement: ranks {idle[:8]}{' ...' if len(idle) > 8 else ''} are in neither "
                          f"placement.generation {p.generation} nor placement.trainer {p.trainer}, below its "
                          f"highest rank {cfg.world_ranks - 1}, and would sit idle (holding their devices); list them "
                          "in one of the two, or renumber the placement")
    if world_size is not None and world_size > cfg.world_ranks:
        idle = list(range(cfg.world_ranks, world_size))
        raise ConfigError(f"world size {world_size}: ranks {idle[:8]}{' ...' if len(idle) > 8 else ''} are in neither "
                          f"placement.generation {p.generation} nor placement.trainer {p.trainer} and would sit idle "
                          f"(holding their devices); launch {cfg.world_ranks} processes (--nproc-per-node/--nnodes), or "
                          "list them in the placement (processes that come later join with --join)")


def _check_kl_horizon(cfg: Config) -> None:
    """An adaptive KL coefficient (trainer.kl_target) must stay positive: an iteration below the
    target multiplies it by 1 - 0.2 x samples / kl_horizon."""
    from workers.trainer.kl_control import MAX_ERROR

    t = cfg.trainer
    if getattr(t, "kl_target", 0) > 0:
        n = cfg.train.batch_prompts * cfg.train.group_size
        if MAX_ERROR * n >= t.kl_horizon:
            raise ConfigError(f"trainer.kl_horizon ({t.kl_horizon}) must be > {MAX_ERROR} x the samples of an "
                              f"iteration ({n} = train.batch_prompts x train.group_size): below the target, one "
                              f"update multiplies the KL coefficient by 1 - {MAX_ERROR} x {n} / {t.kl_horizon} = "
                              f"{1 - MAX_ERROR * n / t.kl_horizon:.3g}, turning the penalty off or into a bonus "
                              f"(verl's default horizon is 10000)")


def _check_group_filter(cfg: Config) -> None:
    """trainer.filter_groups compares a prompt's samples and keeps at most the generated groups."""
    t, tr = cfg.train, cfg.trainer
    if not getattr(tr, "filter_groups", False):
        return
    if tr.algorithm == "remax":
        raise ConfigError("trainer.filter_groups drops groups whose samples all scored the same, but under remax such "
                          "a group still learns from its greedy baseline's reward; leave filter_groups off with remax")
    if t.group_size < 2:
        raise ConfigError(f"trainer.filter_groups drops groups whose samples all scored the same; train.group_size "
                          f"{t.group_size} leaves nothing to compare: set it >= 2")
    most = t.batch_prompts * tr.max_gen_batches
    if tr.max_gen_batches and tr.train_groups > most:
        raise ConfigError(f"trainer.train_groups ({tr.train_groups}) must be <= train.batch_prompts x "
                          f"trainer.max_gen_batches ({t.batch_prompts} x {tr.max_gen_batches} = {most}), the most "
                          "groups an iteration generates (verl's gen_batch_size x max_num_gen_batches)")


def _check_sample_ids(cfg: Config) -> None:
    """An iteration's sample ids (``iteration x SAMPLE_STRIDE`` + its index) stay below the next
    iteration's: every request of its batches, refills included."""
    t, tr = cfg.train, cfg.trainer
    per_prompt = requests_per_prompt(cfg)
    per_batch = t.batch_prompts * per_prompt
    batches = max(tr.max_gen_batches, 1) if getattr(tr, "train_groups", 0) else 1  # 0: no refill
    if per_batch * batches >= SAMPLE_STRIDE:
        plus = " (+ 1: remax's greedy response)" if per_prompt > t.group_size else ""
        refills = f"trainer.max_gen_batches ({tr.max_gen_batches}) x " if batches > 1 else ""
        raise ConfigError(f"{refills}train.batch_prompts x train.group_size{plus} ({per_batch} samples a batch) "
                          f"must stay below {SAMPLE_STRIDE} samples an iteration")


def _check_multi_turn(cfg: Config) -> None:
    """``multi_turn.env`` loads (a built-in name, or your own function or class, imported here)
    and the tool schemas read (``multi_turn.tools``, or the env's ``TOOLS``), and what a
    multi-turn run cannot do: a forced length (turns end in EOS), per-sequence policy losses and
    the rollout bypass (the sampler's log-probs; observation tokens have none)."""
    mt, t, tr = cfg.multi_turn, cfg.train, cfg.trainer
    if mt.tools and not mt.env:
        raise ConfigError(f"multi_turn.tools: {mt.tools!r} is given without multi_turn.env; the tools' calls need an "
                          "environment to answer them (as verl's tool_config_path needs multi_turn.enable)")
    if not mt.env:
        return
    from workers.tasks.envs import load_env
    from workers.tasks.envs.tools import run_tools
    from workers.trainer.multi_turn import UNMASKED_POLICY_LOSSES, masked_policy_losses

    try:
        load_env(mt.env)
        run_tools(mt)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    on = f"multi_turn.env ({mt.env!r})"
    if t.min_tokens > 0:
        raise ConfigError(f"train.min_tokens: {t.min_tokens} cannot be used with {on}: a turn goes to the environment "
                          "when it ends in EOS, and min_tokens ignores EOS over the whole response; set "
                          "train.min_tokens: 0, or leave multi_turn.env out")
    if t.length_trace:
        raise ConfigError(f"train.length_trace forces each response's length, which cannot be used with {on} (turns "
                          "end in EOS, observations add tokens); leave train.length_trace or multi_turn.env out")
    if getattr(tr, "policy_loss", "ppo") in UNMASKED_POLICY_LOSSES:
        raise ConfigError(f"trainer.policy_loss: {tr.policy_loss} takes statistics over a sequence's or a "
                          "micro-batch's tokens (a sequence ratio or gate, a covariance) that would count the "
                          f"environment's observation tokens, so it cannot be used with {on}; use one of "
                          f"{', '.join(masked_policy_losses())}, or leave multi_turn.env out")
    if getattr(tr, "rollout_bypass", False):
        raise ConfigError(f"trainer.rollout_bypass: true takes the sampler's log-probs as the old policy, which "
                          f"cannot be used with {on} (observation tokens were not sampled); leave "
                          "trainer.rollout_bypass out, or multi_turn.env")


def requests_per_prompt(cfg) -> int:
    """The generation requests of one prompt: ``train.group_size`` samples, and under remax its
    greedy baseline response (controller/program.py)."""
    return cfg.train.group_size + (getattr(cfg.trainer, "algorithm", "") == "remax")


def check_staleness(mode: str, max_staleness: int | None) -> None:
    """A mode with lag L trains samples generated up to L weight versions back (controller/
    modes.py); the trainer skips samples older than ``trainer.max_staleness``, so it must be
    >= L (values above L change nothing: no sample is older)."""
    lag = MODES[mode].lag
    if max_staleness is not None and max_staleness < lag:
        sync = ", ".join(m.name for m in MODES.values() if m.lag <= max_staleness)
        raise ConfigError(f"trainer.max_staleness: {max_staleness} is below the lag of pipeline.mode {mode} ({lag}: "
                          f"its samples come from weights up to {lag} version(s) old), so the trainer would skip "
                          f"every sample as stale; set trainer.max_staleness >= {lag}, or a pipeline.mode with "
                          f"lag <= {max_staleness} ({sync})")


def _check_registries(cfg: Config) -> None:
    """Names that select a registered implementation (task, engine backend and admission key,
    dispatcher, ranker kind), the dispatcher's options (building one is cheap and pure) and its
    profile file; a task's kwargs are checked when the controller builds it, before any other
    work."""
    from controller.scheduling import DISPATCHERS, ON_ESTIMATES, PTLProfile, make_dispatcher, runnable
    from workers.tasks.registry import task_factory

    try:
        task_factory(cfg.task.name)  # a plugin is imported here: its errors at load, on every rank
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from workers.generation.admission import check_admission
    from workers.tasks.plugins import is_plugin

    from workers.generation.factory import check_backend

    try:  # your own key: loaded and tried on a probe request; your own engine: loaded, not built
        check_admission(cfg.engine.admission)
        check_backend(cfg.engine.backend)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.dispatch.name not in DISPATCHERS and not is_plugin(cfg.dispatch.name):
        raise ConfigError(f"dispatch.name: {cfg.dispatch.name!r} is not one of {sorted(DISPATCHERS)}, nor "
                          "module:Name / file.py:Name of your own dispatcher")
    try:
        dispatcher = make_dispatcher(cfg.dispatch.name, **dict(cfg.dispatch.options))
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e) if str(e).startswith("dispatch.name") else f"dispatch.options: {e}") from None
    try:
        runnable(dispatcher)
    except ValueError as e:
        raise ConfigError(f"dispatch.name: {cfg.dispatch.name}: {e}") from None
    if cfg.dispatch.profile:
        if not Path(cfg.dispatch.profile).is_file():
            what = "is a folder" if Path(cfg.dispatch.profile).is_dir() else "does not exist"
            raise ConfigError(f"dispatch.profile: {cfg.dispatch.profile} {what} (a saved PTLProfile JSON file, "
                              "docs/scheduling.md; empty or null: a flat default profile)")
        try:
            PTLProfile.load(cfg.dispatch.profile)
        except (OSError, ValueError, TypeError) as e:  # the error names the file
            raise ConfigError(f"dispatch.profile: {e}") from None
    if cfg.ranker.kind != "none":
        _check_ranker(cfg.ranker)
    elif cfg.dispatch.name in ON_ESTIMATES:
        # every estimate would be max_tokens: skew plans what round_robin does, skew_paper caps
        # every batch for full-length sequences and puts the first 20% of requests in its
        # long-tail class (~2x round_robin's makespan in a simulation of a lognormal batch)
        raise ConfigError(f"dispatch.name: {cfg.dispatch.name} dispatches on output-length estimates, and "
                          "ranker.kind: none gives every request the same one (max_tokens); set ranker.kind "
                          "(lgbm, lm, ensemble, or your own class) or use round_robin")


def _check_ranker(r: RankerSection) -> None:
    """The kind is registered, its options build a ranker (cheap: a config, no model), and a
    ranker already saved at ``path`` is of that kind (it is what the run loads)."""
    from ranker.store import KINDS, build

    try:  # (the kind's name is checked first, by RankerSection; your own class loads here)
        model = build(r.kind, **dict(r.options))
        min_rows = model.min_rows
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e) if str(e).startswith("ranker.kind") else f"ranker.options: {e}") from None
    except Exception as e:  # noqa: BLE001 - your own class's constructor: one line, not a traceback per rank
        if r.kind in KINDS:
            raise
        raise ConfigError(f"ranker.kind: {r.kind!r}: building it with ranker.options {dict(r.options)} failed "
                          f"({type(e).__name__}: {e})") from None
    if r.bootstrap_prompts < min_rows and not (Path(r.path) / "meta.json").exists():
        raise ConfigError(f"ranker.bootstrap_prompts: {r.bootstrap_prompts}, but a {r.kind} ranker with these "
                          f"options fits on at least {min_rows} prompts (raise it, or lower "
                          "min_child_samples in ranker.options for lgbm)")
    try:  # a damaged folder is reported by the ranker's own load, naming the file
        saved = json.loads((Path(r.path) / "meta.json").read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(saved, str) and saved != r.kind:
        raise ConfigError(f"ranker.kind: {r.kind!r}, but {r.path} holds a {saved!r} ranker (set ranker.kind: "
                          f"{saved}, or point ranker.path at an empty folder to bootstrap a {r.kind} one)")
