"""Run configuration: YAML -> frozen, typed dataclasses, validated once at load.

Every key is checked here, before any process does work: an unknown key, a wrong type or an
impossible placement raises ``ConfigError`` naming the key (``placement.trainer[1]: rank 5 >=
world size 3``). Sections owned by other components are converted into their own config
classes (``engine`` -> ``EngineConfig``, ``trainer`` -> ``TrainerConfig``, ``topology`` ->
``Topology``) so their validation runs at load too.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from controller.config_ranges import range_error
from controller.modes import MODES
from controller.prompt_check import OVERLONG_POLICIES
from workers.trainer.config import VERL_LOSS_AGGS
from workers.types import GREEDY_BELOW, SERVED_TEMPERATURES, temperature_served

PIPELINE_MODES = tuple(MODES)


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""


@dataclass(frozen=True)
class ModelSection:
    """``path``: HF folder of the policy. ``init``: when set and ``path`` has no model yet, a
    fresh model with these ``workers.model_config.ModelConfig`` fields is built there (quickstart)."""

    path: str = "runs/quickstart/model"
    init: dict | None = None


@dataclass(frozen=True)
class TokenizerSection:
    """The tokenizer is the model folder's (``tokenizer.json``, as Hugging Face). Prompts are
    formatted by the folder's chat template, else by ``prompt_template`` (``str.format`` with
    ``{prompt}``): set here, it overrides the folder's and is saved into a model built by
    ``model.init`` (its SFT warm start uses it too)."""

    prompt_template: str = ""

    def __post_init__(self):
        from workers.tokenizer import check_prompt_template

        if self.prompt_template:
            try:  # here, not when the first prompt is formatted on a worker
                check_prompt_template(self.prompt_template)
            except ValueError as e:
                raise ConfigError(f"tokenizer.prompt_template: {e}") from None


@dataclass(frozen=True)
class TaskSection:
    name: str = "synthetic"
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineSection:
    mode: str = "async_stream"
    minibatch_size: int = 8  # samples per hand-over in ``minibatch`` mode
    # instance -> trainer sample stream: samples finishing within this window share one RPC
    stream_window_s: float = 0.02

    def __post_init__(self):
        if self.mode not in PIPELINE_MODES:
            raise ConfigError(f"pipeline.mode: {self.mode!r} is not one of {PIPELINE_MODES}")


@dataclass(frozen=True)
class DispatchSection:
    name: str = "round_robin"  # controller.scheduling.make_dispatcher name
    options: dict = field(default_factory=dict)  # its constructor kwargs (e.g. alphas, order)
    profile: str = ""  # PTLProfile JSON; empty: a flat default profile per instance


@dataclass(frozen=True)
class RankerSection:
    kind: str = "none"  # "none": est_len = max_tokens; otherwise load (or bootstrap) the ranker at path
    path: str = ""
    update_every: int = 0  # K > 0: online update with the last K iterations' lengths, every K
    bootstrap_prompts: int = 256  # no ranker at path yet: measure the policy on this many prompts
    options: dict = field(default_factory=dict)  # the bootstrapped ranker's config (ranker.build)

    def __post_init__(self):
        if self.kind != "none" and not self.path:
            raise ConfigError(f"ranker.path: kind {self.kind!r} loads a trained ranker folder "
                              "(python -m ranker train ... --out DIR); path is empty")
        if self.kind == "none" and isinstance(self.update_every, int) and self.update_every > 0:
            raise ConfigError(f"ranker.update_every: {self.update_every} updates a ranker online, but ranker.kind is "
                              "'none' (no ranker); set ranker.kind and ranker.path, or update_every: 0")


@dataclass(frozen=True)
class PlacementSection:
    """Global ranks per role; rank 0 is always the controller. ``colocated``: the generation
    and trainer lists must be equal (time-multiplexed). ``elastic``: generation instances may
    join (``--join``) and leave at run time."""

    generation: list = field(default_factory=lambda: [1])
    trainer: list = field(default_factory=lambda: [2])
    colocated: bool = False
    elastic: bool = True
    rpc_timeout_s: float = 300.0
    force_scale_out_at: int = -1  # test hook: add a waiting joiner at this iteration


@dataclass(frozen=True)
class TrainSection:
    iterations: int = 20
    batch_prompts: int = 16
    group_size: int = 4
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    # rollout filters (as vLLM's): top_k 0 and top_p 1 are off; with either on, the trainer
    # recomputes the old log-probs on the full distribution (recompute_old_logprobs), as verl
    top_k: int = 0
    top_p: float = 1.0
    eval_every: int = 0  # 0: never
    eval_prompts: int = 32  # 0: the whole test split
    eval_samples: int = 1  # generations per eval prompt (verl's val_kwargs.n)
    eval_temperature: float = 0.0  # 0: greedy (verl's val_kwargs.temperature / do_sample)
    ckpt_every: int = 0  # 0: only at the end
    ckpt_keep: int | None = None  # keep the newest N checkpoints (None: all, as verl's max_actor_ckpt_to_keep)
    sft_steps: int = 0
    sft_lr: float = 3e-3
    seed: int = 0
    # length-forced runs (the paper's benchmarks): each training prompt generates exactly the
    # length of one trace row's first answer (words x 1.3 tokens x length_scale, within
    # [1, max_tokens]); the row is fixed per prompt (hash of its text)
    length_trace: str = ""
    length_scale: float = 1.0
    # a prompt with no room for an output token in the engines' context: "error" at start
    # (naming it), or "skip" it (controller/prompt_check.py)
    overlong_prompts: str = "error"
    max_prompt_tokens: int = 0  # > 0: prompts longer than this are over-long too (verl's max_prompt_length)


@dataclass(frozen=True)
class LoggingSection:
    logdir: str = "runs/quickstart"
    timeline_every: int = 5  # Gantt figure to TensorBoard every K iterations (0: never)
    progress: bool = True


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    task: TaskSection = field(default_factory=TaskSection)
    engine: Any = None  # workers.generation.config.EngineConfig
    trainer: Any = None  # workers.trainer.config.TrainerConfig
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    dispatch: DispatchSection = field(default_factory=DispatchSection)
    ranker: RankerSection = field(default_factory=RankerSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    topology: Any = None  # workers.weight_sync.Topology
    weight_sync: Any = None  # workers.weight_sync.WeightSyncConfig (its topology: the one above)
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)

    @property
    def world_ranks(self) -> int:
        """Smallest world that holds the placement (controller + every listed rank)."""
        return 1 + max([0, *self.placement.generation, *self.placement.trainer])

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)


def _check_range(key: str, value: Any) -> None:
    why = range_error(key, value)
    if why is not None:
        raise ConfigError(why)


# ---- conversion -------------------------------------------------------------------------
def _check_type(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a simple type hint (int, float, bool, str, list, dict, tuple[X, ...],
    X | None); floats must be finite."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                return _check_type(key, value, a)
    if hint is Any:
        return value
    base = origin or hint
    if base is tuple and isinstance(value, list):
        value = tuple(value)
    if base is tuple and isinstance(value, tuple) and typing.get_args(hint):
        args = typing.get_args(hint)
        if args[-1] is Ellipsis:
            args = args[:1] * len(value)
        elif len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}: {list(value)!r}")
        return tuple(_check_type(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if base is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value}")
    if base is int and isinstance(value, bool) or not isinstance(value, base):
        quote = (" (YAML read the value as a mapping or a list: ': ', '{', '[' in it; put it in YAML quotes, '...')"
                 if isinstance(value, (dict, list)) and base is str else "")
        raise ConfigError(f"{key}: expected {getattr(base, '__name__', base)}, got "
                          f"{type(value).__name__} {value!r}{quote}")
    return value


# verl's names for what a run config says elsewhere (docs/migrating_from_verl.md has the rest)
VERL_KEYS = {
    "data": "task (the dataset) and train (batch, lengths)", "actor_rollout_ref": "trainer, engine and train",
    "algorithm": "trainer", "custom_reward_function": "task.kwargs.verifier", "train_files": "task.kwargs.files",
    "val_files": "task.kwargs.files", "train_batch_size": "train.batch_prompts",
    "max_response_length": "train.max_tokens", "total_training_steps": "train.iterations",
    "save_freq": "train.ckpt_every", "test_freq": "train.eval_every", "adv_estimator": "trainer.algorithm",
    "max_actor_ckpt_to_keep": "train.ckpt_keep",
    "max_critic_ckpt_to_keep": "train.ckpt_keep (one key: the critic is saved in the actor's checkpoint)",
    "kl_loss_coef": "trainer.kl_coef", "kl_loss_type": "trainer.kl_estimator",
    "entropy_coeff": "trainer.entropy_coef",
    "enable_gradient_checkpointing": "trainer.activation_checkpointing (actor and critic)",
    "loss_agg_mode": "trainer.loss_agg (" + ", ".join(f"{v}: {o}" for v, o in VERL_LOSS_AGGS.items()) + ")",
    "clip_ratio": "trainer.clip_low and trainer.clip_high", "clip_ratio_c": "trainer.dual_clip",
    "n": "train.group_size", "default_local_dir": "logging.logdir",
    "ppo_mini_batch_size": "trainer.mini_batches (= train_batch_size / ppo_mini_batch_size)",
    "val_kwargs": "train.eval_samples and train.eval_temperature",
}


def _hint(key: str, known) -> str:
    """', did you mean X?' for a near miss or a verl name, else ''."""
    import difflib

    if key in VERL_KEYS:
        return f"; verl's {key!r} is {VERL_KEYS[key]} here (docs/migrating_from_verl.md)"
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def _none_as_empty(cls, name: str, value: Any, hint: Any) -> Any:
    """YAML null (``profile:``, ``profile: null``, ``--set dispatch.profile=null``) for a string
    key whose default is empty (empty: none, off) reads as that empty string."""
    if value is None and hint is str:
        default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        if default == "":
            return ""
    return value


def _build(cls, section: str, data: Any):
    """Instantiate dataclass ``cls`` from a mapping, naming unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{section}.{k}: unknown key{_hint(k, names)} (known: {sorted(names)})")
    kwargs = {k: _check_type(f"{section}.{k}", _none_as_empty(cls, k, v, hints[k]), hints[k])
              for k, v in data.items()}
    for k, v in kwargs.items():
        _check_range(f"{section}.{k}", v)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(section) else f"{section}: {msg}") from e


# sections owned by another component: (module, class) of their config dataclass
OWNED_SECTIONS = {"engine": ("workers.generation.config", "EngineConfig"),
                  "trainer": ("workers.trainer.config", "TrainerConfig")}


def _owned_section(section: str, data: Any):
    """Convert a section owned by another component into its config class when that
    component is installed; otherwise keep the validated mapping."""
    import importlib

    module, cls_name = OWNED_SECTIONS[section]
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        return dict(data or {})
    return _build(cls, section, data)


def _topology(data: Any):
    try:
        from workers.weight_sync import Topology
    except ImportError:
        return dict(data or {})
    try:
        return Topology.from_config(data or {})
    except (TypeError, ValueError, KeyError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("topology") else f"topology: {msg}") from e


def _weight_sync(data: Any, topology: Any):
    """The ``weight_sync`` section (bucket_mb, tree_shape, naive) with the run's topology."""
    try:
        from workers.weight_sync import WeightSyncConfig
    except ImportError:
        return dict(data or {})
    if isinstance(data, dict) and "topology" in data:
        raise ConfigError("weight_sync.topology: a run's topology is the top-level `topology:` section "
                          "(the planner reads it too); move it there")
    try:
        return dataclasses.replace(WeightSyncConfig.from_dict(data), topology=topology)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def from_dict(d: dict, world_size: int | None = None) -> Config:
    """Build and validate a Config; ``world_size`` (when known) checks the placement."""
    if not isinstance(d, dict):
        raise ConfigError(f"config: expected a mapping at top level, got {type(d).__name__}")
    sections = {f.name for f in dataclasses.fields(Config)}
    for k in d:
        if k not in sections:
            raise ConfigError(f"{k}: unknown section{_hint(k, sections)} (known: {sorted(sections)})")
    topology = _topology(d.get("topology"))
    train = _build(TrainSection, "train", d.get("train"))
    trainer = _trainer_from_train(
        _owned_section("trainer", _norm_follows(d.get("trainer"), train)),
        train, set(d.get("trainer") or {}))
    cfg = Config(
        model=_build(ModelSection, "model", d.get("model")),
        tokenizer=_build(TokenizerSection, "tokenizer", d.get("tokenizer")),
        task=_build(TaskSection, "task", d.get("task")),
        engine=_owned_section("engine", d.get("engine")),
        trainer=trainer,
        pipeline=_build(PipelineSection, "pipeline", d.get("pipeline")),
        dispatch=_build(DispatchSection, "dispatch", d.get("dispatch")),
        ranker=_build(RankerSection, "ranker", d.get("ranker")),
        placement=_build(PlacementSection, "placement", d.get("placement")),
        topology=topology,
        weight_sync=_weight_sync(d.get("weight_sync"), topology),
        train=train,
        logging=_build(LoggingSection, "logging", d.get("logging")),
    )
    validate(cfg, world_size)
    return cfg


def _norm_follows(trainer: Any, train: TrainSection) -> Any:
    """``trainer.loss_scale_factor`` of ``loss_agg: seq_mean_token_sum_norm`` follows
    ``train.max_tokens`` unless set (verl divides by the padded response length,
    max_response_length). Before the trainer section is built: the mode needs the factor."""
    if isinstance(trainer, dict) and trainer.get("loss_agg") == "seq_mean_token_sum_norm" \
            and "loss_scale_factor" not in trainer:
        return {**trainer, "loss_scale_factor": max(train.max_tokens, 1)}  # < 1: validate() says so
    return trainer


def _trainer_from_train(trainer, train: TrainSection, explicit: set):
    """Trainer settings that follow the run unless the trainer section sets them: the
    temperature its log-probs are taken at (the samples' ``train.temperature``; greedy samples
    carry T = 1 log-probs; checked when set), the LR schedule's length ``total_steps`` (one
    scheduler step per iteration: ``train.iterations``), and ``recompute_old_logprobs`` when the
    rollout filters tokens (``train.top_k`` / ``top_p``; checked when set)."""
    if not dataclasses.is_dataclass(trainer):  # the trainer component is not installed
        return trainer
    rollout = train.temperature if train.temperature >= GREEDY_BELOW else 1.0
    if "temperature" in explicit and trainer.temperature != rollout:
        raise ConfigError(f"trainer.temperature: {trainer.temperature} differs from the rollout's "
                          f"train.temperature {train.temperature} (the PPO ratio, KL and entropy must be taken "
                          "at the sampling temperature); leave it out, it is taken from train.temperature")
    follow = {"temperature": rollout, "total_steps": max(train.iterations, 1)}  # < 1: validate() says so
    if train.top_k > 0 or train.top_p < 1.0:
        # the sampler's log-probs are of the filtered distribution; the trainer's are not
        if "recompute_old_logprobs" in explicit and not trainer.recompute_old_logprobs:
            raise ConfigError("trainer.recompute_old_logprobs: must be true with train.top_k / train.top_p "
                              "(the samples' log-probs are of the filtered distribution, the trainer's of the "
                              "full one: the PPO ratio would not be 1 on-policy); leave it out, it follows")
        follow["recompute_old_logprobs"] = True
    try:
        return dataclasses.replace(trainer, **{k: v for k, v in follow.items() if k not in explicit})
    except ValueError as e:
        raise ConfigError(f"{e} (trainer.total_steps follows train.iterations = {train.iterations} "
                          "unless set)") from None


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
    colocated = cfg.pipeline.mode == "colocated" or p.colocated
    if colocated and sorted(p.generation) != sorted(p.trainer):
        same = list(range(1, len(p.trainer) + 1))
        raise ConfigError(f"placement: colocated needs generation == trainer ranks, got {p.generation} vs "
                          f"{p.trainer}; generation and training take turns on the same ranks: e.g. "
                          f"placement.generation={same} placement.trainer={same} ({len(same) + 1} processes)")
    if not colocated and set(p.generation) & set(p.trainer):
        raise ConfigError(f"placement: ranks {sorted(set(p.generation) & set(p.trainer))} are in both "
                          "generation and trainer; set placement.colocated or pipeline.mode: colocated")
    for key in ("temperature", "eval_temperature"):  # the gap no engine serves (RANGES bounds the rest)
        if not temperature_served(getattr(t, key)):
            raise ConfigError(f"train.{key} must be {SERVED_TEMPERATURES}, got {getattr(t, key)!r}")
    if t.min_tokens > t.max_tokens:
        raise ConfigError(f"train.min_tokens must be <= train.max_tokens ({t.max_tokens}), got {t.min_tokens}")
    if t.length_trace and not Path(t.length_trace).is_file():
        raise ConfigError(f"train.length_trace: {t.length_trace} does not exist (a length trace, "
                          "e.g. data/length_traces/llama33_70b_rg_easy.val.jsonl.gz)")
    if t.overlong_prompts not in OVERLONG_POLICIES:
        raise ConfigError(f"train.overlong_prompts: {t.overlong_prompts!r} is not one of {OVERLONG_POLICIES}")
    check_staleness(cfg.pipeline.mode, getattr(cfg.trainer, "max_staleness", None))
    algorithm = getattr(cfg.trainer, "algorithm", None)
    if algorithm in ("grpo", "rloo") and t.temperature < GREEDY_BELOW:
        raise ConfigError(f"train.temperature: {algorithm} with greedy sampling ({t.temperature}) draws the same "
                          "sample group_size times, so every group's advantages are 0 and nothing trains; "
                          "sample at a temperature > 0")
    if t.eval_samples > 1 and t.eval_temperature < GREEDY_BELOW:
        raise ConfigError(f"train.eval_samples: {t.eval_samples} greedy samples of a prompt are all the same; "
                          "set train.eval_temperature > 0")
    if algorithm in ("grpo", "rloo") and t.group_size < 2:
        raise ConfigError(f"train.group_size: {algorithm} needs >= 2 samples per prompt (its advantages "
                          f"compare a sample with its group's others), got {t.group_size}")
    _check_registries(cfg)
    if world_size is not None and world_size < 2:
        raise ConfigError(f"world size {world_size}: needs a controller and at least one worker rank")


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
    """Names that select a registered implementation (task, dispatcher, ranker kind), the
    dispatcher's options (building one is cheap and pure) and its profile file; a task's
    kwargs are checked when the controller builds it, before any other work."""
    from controller.scheduling import DISPATCHERS, PTLProfile, make_dispatcher, runnable
    from workers.tasks.registry import task_factory

    try:
        task_factory(cfg.task.name)  # a plugin is imported here: its errors at load, on every rank
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.dispatch.name not in DISPATCHERS:
        raise ConfigError(f"dispatch.name: {cfg.dispatch.name!r} is not one of {sorted(DISPATCHERS)}")
    try:
        dispatcher = make_dispatcher(cfg.dispatch.name, **dict(cfg.dispatch.options))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"dispatch.options: {e}") from None
    try:
        runnable(dispatcher)
    except ValueError as e:
        raise ConfigError(f"dispatch.name: {cfg.dispatch.name}: {e}") from None
    if cfg.dispatch.profile:
        if not Path(cfg.dispatch.profile).is_file():
            raise ConfigError(f"dispatch.profile: {cfg.dispatch.profile} does not exist (a saved PTLProfile JSON, "
                              "docs/scheduling.md; empty or null: a flat default profile)")
        try:
            PTLProfile.load(cfg.dispatch.profile)
        except (OSError, ValueError, TypeError) as e:  # the error names the file
            raise ConfigError(f"dispatch.profile: {e}") from None
    if cfg.ranker.kind != "none":
        _check_ranker(cfg.ranker)


def _check_ranker(r: RankerSection) -> None:
    """The kind is registered, its options build a ranker (cheap: a config, no model), and a
    ranker already saved at ``path`` is of that kind (it is what the run loads)."""
    from ranker.store import KINDS, build

    if r.kind not in KINDS:
        raise ConfigError(f"ranker.kind: {r.kind!r} is not one of {['none', *sorted(KINDS)]}")
    try:
        build(r.kind, **dict(r.options))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"ranker.options: {e}") from None
    try:  # a damaged folder is reported by the ranker's own load, naming the file
        saved = json.loads((Path(r.path) / "meta.json").read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(saved, str) and saved != r.kind:
        raise ConfigError(f"ranker.kind: {r.kind!r}, but {r.path} holds a {saved!r} ranker (set ranker.kind: "
                          f"{saved}, or point ranker.path at an empty folder to bootstrap a {r.kind} one)")


def load_config(path: str | Path, world_size: int | None = None,
                overrides: dict | typing.Sequence[str] | None = None) -> Config:
    """Read YAML ``path`` plus ``overrides`` into a Config. ``overrides``: the command line's
    ``--set`` texts (``["train.iterations=3", ...]``, parsed here and echoed as typed in an error
    they cause), or a mapping of dotted keys to values ({"train.iterations": 3})."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    from controller.config_overrides import blame, overridden, parse_overrides  # (it imports this module)

    overrides, typed = parse_overrides(overrides)
    try:
        return from_dict(overridden(d, overrides), world_size)
    except ConfigError as e:
        raise ConfigError(f"{blame(d, overrides, typed, world_size, str(e)) or path}: {e}") from None
