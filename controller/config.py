"""Run configuration: YAML -> frozen, typed dataclasses, validated once at load.

Every key is checked here, before any process does work: an unknown key, a wrong type or an
impossible placement raises ``ConfigError`` naming the key (``placement.trainer[1]: rank 5 >=
world size 3``). Sections owned by other components are converted into their own config
classes (``engine`` -> ``EngineConfig``, ``trainer`` -> ``TrainerConfig``, ``topology`` ->
``Topology``) so their validation runs at load too. Each key's own checks (type, range, name)
are ``config_types``; the checks across keys (placement, modes, registries) ``config_checks``.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from controller import trackers
from controller.config_checks import validate
from controller.config_types import ConfigError, build_section, key_hint
from controller.config_yaml import read_config_file
from controller.modes import MODES
from controller.rpc import COLLECTIVE_TIMEOUT_S, RPC_TIMEOUT_S
from workers.config_schema import DERIVED, SEEDS, Range, key_fields, ranged
from workers.generation.config import EngineConfig
from workers.trainer.config import TrainerConfig
from workers.types import GREEDY_BELOW, MAX_TEMPERATURE, MIN_SAMPLED_TEMPERATURE
from workers.weight_sync import Topology, WeightSyncConfig

PIPELINE_MODES = tuple(MODES)
# Every int / float key of a run section declares its valid values next to it (``ranged``),
# checked at load after the types (every float must also be finite: no .nan/.inf); a tuple's
# range applies to each value. docs/config.md lists the same.
TEMPERATURES = f"below {GREEDY_BELOW:g}: greedy; sampled from {MIN_SAMPLED_TEMPERATURE:g}, as both engines serve"
# the ranges of an owned section whose class declares none itself
OWNED_RANGES = {"engine": {"seed": SEEDS}}


@dataclass(frozen=True)
class ModelSection:
    """``path``: HF folder of the policy. ``init``: when set and ``path`` has no model yet, a
    fresh model with these ``workers.model_config.ModelConfig`` fields is built there (quickstart)."""

    path: str = "runs/quickstart/model"
    init: dict | None = None

    def __post_init__(self):
        _path_key(self, "model", "path", "the Hugging Face model folder of the policy (config.json, "
                  "*.safetensors, tokenizer.json), or where model.init builds one")


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

    def __post_init__(self):
        _path_key(self, "task", "name")  # ~/my_rl/tasks.py:Name


@dataclass(frozen=True)
class PipelineSection:
    mode: str = "async_stream"
    minibatch_size: int = ranged(8, Range(1))  # samples per hand-over in ``minibatch`` mode
    # instance -> trainer sample stream: samples finishing within this window share one RPC
    stream_window_s: float = ranged(0.02, Range(0, 10, note="seconds"))

    def __post_init__(self):
        if self.mode not in PIPELINE_MODES:
            raise ConfigError(f"pipeline.mode: {self.mode!r} is not one of {PIPELINE_MODES}")


@dataclass(frozen=True)
class DispatchSection:
    name: str = "round_robin"  # controller.scheduling.make_dispatcher name
    options: dict = field(default_factory=dict)  # its constructor kwargs (e.g. alphas, order)
    profile: str = ""  # PTLProfile JSON; empty: a flat default profile per instance

    def __post_init__(self):
        _path_key(self, "dispatch", "profile")


@dataclass(frozen=True)
class RankerSection:
    kind: str = "none"  # "none": est_len = max_tokens; otherwise load (or bootstrap) the ranker at path
    path: str = ""
    # K > 0: online update with the last K iterations' lengths, every K
    update_every: int = ranged(0, Range(0, note="0: never"))
    bootstrap_prompts: int = ranged(256, Range(2))  # no ranker at path yet: measure the policy on this many prompts
    options: dict = field(default_factory=dict)  # the bootstrapped ranker's config (ranker.build)

    def __post_init__(self):
        from ranker.store import KINDS, canonical_kind, is_kind  # (a registry of names: imports no model code)

        if self.kind != "none" and not is_kind(self.kind):  # before the path: a typo here is what is wrong
            raise ConfigError(f"ranker.kind: {self.kind!r} is not one of {['none', *sorted(KINDS)]}, nor "
                              f"module:Name / file.py:Name of your own{key_hint(self.kind, KINDS)}")
        if self.kind != "none":  # your own file.py:Name with its absolute path, as saved folders record it
            object.__setattr__(self, "kind", canonical_kind(self.kind))
        _path_key(self, "ranker", "path")
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
    rpc_timeout_s: float = ranged(RPC_TIMEOUT_S, Range(0, open_lo=True))
    # how long a trainer rank's collectives (the gradient all-reduce) wait for a peer that is
    # alive but behind (a slower reward, more tokens); a lost peer is the heartbeat's to find
    collective_timeout_s: float = ranged(COLLECTIVE_TIMEOUT_S, Range(0, open_lo=True))
    # test hook: add a waiting joiner at this iteration
    force_scale_out_at: int = ranged(-1, Range(-1, note="-1: never"))


@dataclass(frozen=True)
class TrainSection:
    # the run's length: null (the default) is 20, unless train.epochs sets it
    iterations: int | None = ranged(None, Range(1, note="null: 20, or derived from train.epochs"))
    # verl's total_epochs: the iterations are derived at start, once the prompt check has kept
    # the train prompts: epochs x (prompts // batch_prompts), as verl's drop_last dataloader
    # counts them (controller/epochs.py)
    epochs: int | None = ranged(None, Range(1, note="null: train.iterations sets the length"))
    batch_prompts: int = ranged(16, Range(1))
    group_size: int = ranged(4, Range(1))
    max_tokens: int = ranged(16, Range(1))
    min_tokens: int = ranged(0, Range(0))
    temperature: float = ranged(1.0, Range(0, MAX_TEMPERATURE, note=TEMPERATURES))
    # rollout filters (as vLLM's): top_k 0 and top_p 1 are off; with either on, the trainer
    # recomputes the old log-probs on the full distribution (recompute_old_logprobs), as verl
    top_k: int = ranged(0, Range(-1, note="0 or -1: off"))
    top_p: float = ranged(1.0, Range(0, 1, open_lo=True, note="1: off"))
    eval_every: int = ranged(0, Range(0, note="0: never"))
    # an evaluation of the starting weights before a fresh run's first iteration (verl's
    # val_before_train), logged at step -1: the one after iteration i is at step i
    eval_before_train: bool = False
    eval_prompts: int = ranged(32, Range(0, note="0: the whole test split"))
    eval_samples: int = ranged(1, Range(1))  # generations per eval prompt (verl's val_kwargs.n)
    # 0: greedy (verl's val_kwargs.temperature / do_sample)
    eval_temperature: float = ranged(0.0, Range(0, MAX_TEMPERATURE, note=TEMPERATURES))
    ckpt_every: int = ranged(0, Range(0, note="0: only at the end"))
    # keep the newest N checkpoints (as verl's max_actor_ckpt_to_keep)
    ckpt_keep: int | None = ranged(None, Range(1, note="null: keep every checkpoint, as verl's 0 or null"))
    sft_steps: int = ranged(0, Range(0))
    sft_lr: float = ranged(3e-3, Range(0, open_lo=True))
    seed: int = ranged(0, SEEDS)
    # length-forced runs (the paper's benchmarks): each training prompt generates exactly the
    # length of one trace row's first answer (words x 1.3 tokens x length_scale, within
    # [1, max_tokens]); the row is fixed per prompt (hash of its text)
    length_trace: str = ""
    length_scale: float = ranged(1.0, Range(0, open_lo=True))
    # a prompt with no room for an output token in the engines' context: "error" at start
    # (naming it), or "skip" it (controller/prompt_check.py); truncate_*: a prompt longer than
    # max_prompt_tokens is cut to it (verl's data.truncation: left keeps its end, right its
    # start, middle both ends)
    overlong_prompts: Literal["error", "skip", "truncate_left", "truncate_right", "truncate_middle"] = "error"
    # > 0: prompts longer than this are over-long too (verl's max_prompt_length)
    max_prompt_tokens: int = ranged(0, Range(0, note="0: the engines' context"))

    def __post_init__(self):
        _path_key(self, "train", "length_trace")
        if self.iterations is not None and self.epochs is not None:
            raise ConfigError(f"train.iterations ({self.iterations}) and train.epochs ({self.epochs}) both set the "
                              "run's length; set one (train.epochs derives the iterations from the train prompts; "
                              "--set train.iterations=null or train.epochs=null unsets a file's)")
        if self.iterations is None and self.epochs is None:
            object.__setattr__(self, "iterations", 20)
        if self.truncates and not self.max_prompt_tokens:
            raise ConfigError(f"train.overlong_prompts: {self.overlong_prompts} cuts prompts to "
                              "train.max_prompt_tokens, which is 0 (no limit); set it (verl's max_prompt_length)")

    @property
    def truncates(self) -> bool:
        """Prompts over ``max_prompt_tokens`` are cut to it (``overlong_prompts: truncate_*``)."""
        return isinstance(self.overlong_prompts, str) and self.overlong_prompts.startswith("truncate_")

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates on its own (the test split is checked at start)."""
        return bool(self.eval_every or self.eval_before_train)


@dataclass(frozen=True)
class LoggingSection:
    logdir: str = "runs/quickstart"
    timeline_every: int = ranged(5, Range(0, note="0: never"))  # Gantt figure to TensorBoard every K iterations
    progress: bool = True
    # trackers beside TensorBoard (verl's trainer.logger; one name or a list): controller/trackers.py
    trackers: tuple[trackers.TrackerName, ...] | trackers.TrackerName = ()
    project: str = "streamrl"  # verl's trainer.project_name
    experiment: str = ""  # verl's trainer.experiment_name; "": the run folder's name

    def __post_init__(self):
        _path_key(self, "logging", "logdir", "the run's folder (logs, checkpoints), e.g. runs/NAME")
        if isinstance(self.trackers, str):  # `logger: wandb`, as verl takes it
            object.__setattr__(self, "trackers", (self.trackers,))
        why = trackers.missing(self.trackers)
        if why:
            raise ConfigError(f"logging.trackers: {why}")
        if "wandb" in self.trackers and not self.project.strip():
            raise ConfigError("logging.project: empty; wandb needs a project name (default: streamrl)")


def _path_key(section, name: str, key: str, required: str = "") -> None:
    """A path key of a section: ``~`` is the user's home (a YAML value is no shell word, so
    nothing else expands it: ``~/runs`` made a folder named ``~``); ``required``: what the key
    names, when it may not be empty (an empty one failed later, in the bootstrap)."""
    value = getattr(section, key)
    if not isinstance(value, str):
        return  # build_section names a wrong type
    if required and not value.strip():
        default = next(f.default for f in dataclasses.fields(section) if f.name == key)
        raise ConfigError(f"{name}.{key}: empty{f' ({value!r})' if value else ''}; give {required} (or leave the "
                          f"key out for its default, {default})")
    if value.startswith("~"):
        object.__setattr__(section, key, os.path.expanduser(value))


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    task: TaskSection = field(default_factory=TaskSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    dispatch: DispatchSection = field(default_factory=DispatchSection)
    ranker: RankerSection = field(default_factory=RankerSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    # Topology and WeightSyncConfig; typed Any: their YAML keys (datacenters, bucket_mb) are not
    # the classes' fields, so --set takes them free-form (config_overrides.key_type)
    topology: Any = None
    weight_sync: Any = None  # its topology: the one above
    train: TrainSection = field(default_factory=TrainSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    # not a section: the trainer keys the loader filled from the train section because the file
    # did not set them; a run length derived at start (train.epochs) carries over to these
    follows: tuple[str, ...] = field(default=(), metadata={DERIVED: True})

    @property
    def world_ranks(self) -> int:
        """Smallest world that holds the placement (controller + every listed rank)."""
        return 1 + max([0, *self.placement.generation, *self.placement.trainer])

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)


# sections owned by another component: (module, class) of their config dataclass
OWNED_SECTIONS = {"engine": ("workers.generation.config", "EngineConfig"),
                  "trainer": ("workers.trainer.config", "TrainerConfig")}


def _topology(data: Any) -> Topology:
    try:
        return Topology.from_config(data or {})
    except (TypeError, ValueError, KeyError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith("topology") else f"topology: {msg}") from e


def _weight_sync(data: Any, topology: Topology) -> WeightSyncConfig:
    """The ``weight_sync`` section (bucket_mb, tree_shape, naive) with the run's topology."""
    if isinstance(data, dict) and "topology" in data:
        raise ConfigError("weight_sync.topology: a run's topology is the top-level `topology:` section "
                          "(the weight-sync trees read it from there); move it there")
    try:
        return WeightSyncConfig.from_dict(data, topology)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e


def from_dict(d: dict, world_size: int | None = None) -> Config:
    """Build and validate a Config; ``world_size`` (when known) checks the placement."""
    if not isinstance(d, dict):
        raise ConfigError(f"config: expected a mapping at top level, got {type(d).__name__}")
    sections = key_fields(Config)
    for k in d:
        if k not in sections:
            planner = " (a planner cluster file: python -m controller.planner plan --cluster FILE, docs/planner.md)" \
                if "datacenters" in d and "name" in d else ""
            raise ConfigError(f"{k}: unknown section{key_hint(k, sections)} (known: {sorted(sections)}){planner}")
    topology = _topology(d.get("topology"))
    train = build_section(TrainSection, "train", d.get("train"))
    explicit = set(d["trainer"]) if isinstance(d.get("trainer"), dict) else set()
    try:
        trainer = build_section(TrainerConfig, "trainer", _norm_follows(d.get("trainer"), train))
    except ConfigError as e:
        said = str(e).split(" (known: ", 1)[0]  # an unknown key's list of the known ones names it too
        if "total_steps" not in said or "total_steps" in explicit:
            raise
        if train.iterations is None:  # (the placeholder: warmup_steps, or 1)
            raise ConfigError(f"{e} (with train.epochs, trainer.total_steps follows the iterations derived at "
                              "start unless set)") from None
        raise ConfigError(f"{e} (trainer.total_steps follows train.iterations = {train.iterations} "
                          "unless set)") from None
    trainer = _trainer_from_train(trainer, train, explicit)
    cfg = Config(
        model=build_section(ModelSection, "model", d.get("model")),
        tokenizer=build_section(TokenizerSection, "tokenizer", d.get("tokenizer")),
        task=build_section(TaskSection, "task", d.get("task")),
        engine=build_section(EngineConfig, "engine", d.get("engine"), OWNED_RANGES["engine"]),
        trainer=trainer,
        pipeline=build_section(PipelineSection, "pipeline", d.get("pipeline")),
        dispatch=build_section(DispatchSection, "dispatch", d.get("dispatch")),
        ranker=build_section(RankerSection, "ranker", d.get("ranker")),
        placement=build_section(PlacementSection, "placement", _colocated_static(d.get("placement"), d.get("pipeline"))),
        topology=topology,
        weight_sync=_weight_sync(d.get("weight_sync"), topology),
        train=train,
        logging=build_section(LoggingSection, "logging", d.get("logging")),
        follows=() if "total_steps" in explicit else ("total_steps",),
    )
    validate(cfg, world_size)
    return cfg


def _colocated_static(placement: Any, pipeline: Any) -> Any:
    """A colocated run is static: a joined process would hold an instance but no trainer, and
    colocated weights go from the trainer object of the instance's own process (adding one
    ended the run). ``placement.elastic`` defaults to false there; true is refused."""
    colocated = isinstance(pipeline, dict) and pipeline.get("mode") == "colocated"
    if not colocated or not isinstance(placement, (dict, type(None))):
        return placement  # build_section says what is wrong with a placement that is not a mapping
    placement = dict(placement or {})
    if placement.get("elastic") is True:
        raise ConfigError("placement.elastic: true cannot be used with pipeline.mode: colocated (a joined "
                          "process would hold no trainer to take the weights from); leave it out, colocated "
                          "runs are static")
    placement.setdefault("elastic", False)
    return placement


def _norm_follows(trainer: Any, train: TrainSection) -> Any:
    """Before the trainer section is built (its own checks need them), unless it sets them:
    ``trainer.loss_scale_factor`` of ``loss_agg: seq_mean_token_sum_norm`` follows
    ``train.max_tokens`` (verl divides by the padded response length, max_response_length),
    and ``trainer.total_steps`` follows ``train.iterations`` (``warmup_steps`` is checked
    against it; against the default 1,000 a 3,000-iteration run with 1,500 warmup steps was
    refused). With ``train.epochs`` the iterations are known at start only: until then
    ``total_steps`` is ``warmup_steps`` (or 1), and ``controller.epochs`` checks them again."""
    if trainer is None:
        trainer = {}
    if not isinstance(trainer, dict):
        return trainer  # build_section says what is wrong with it
    warmup = trainer.get("warmup_steps")
    placeholder = warmup if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup > 1 else 1
    # < 1: validate() says so
    follow = {"total_steps": max(train.iterations, 1) if train.iterations is not None else placeholder}
    if trainer.get("loss_agg") == "seq_mean_token_sum_norm":
        follow["loss_scale_factor"] = max(train.max_tokens, 1)
    follow["max_response_tokens"] = max(train.max_tokens, 1)  # the overlong penalty counts from it
    return {**{k: v for k, v in follow.items() if k not in trainer}, **trainer}


def _trainer_from_train(trainer: TrainerConfig, train: TrainSection, explicit: set) -> TrainerConfig:
    """Trainer settings that follow the run unless the trainer section sets them: the
    temperature its log-probs are taken at (the samples' ``train.temperature``; greedy samples
    carry T = 1 log-probs; checked when set) and ``recompute_old_logprobs`` when the rollout
    filters tokens (``train.top_k`` / ``top_p``; checked when set). The LR schedule's length
    ``total_steps`` follows ``train.iterations`` before the section is built (``_norm_follows``)."""
    rollout = train.temperature if train.temperature >= GREEDY_BELOW else 1.0
    if "temperature" in explicit and trainer.temperature != rollout:
        raise ConfigError(f"trainer.temperature: {trainer.temperature} differs from the rollout's "
                          f"train.temperature {train.temperature} (the PPO ratio, KL and entropy must be taken "
                          "at the sampling temperature); leave it out, it is taken from train.temperature")
    follow = {"temperature": rollout}
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
        raise ConfigError(str(e)) from None


def load_config(path: str | Path, world_size: int | None = None,
                overrides: dict | typing.Sequence[str] | None = None) -> Config:
    """Read YAML ``path`` plus ``overrides`` into a Config. ``overrides``: the command line's
    ``--set`` texts (``["train.iterations=3", ...]``, parsed here and echoed as typed in an error
    they cause), or a mapping of dotted keys to values ({"train.iterations": 3})."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    d = read_config_file(path) or {}  # a folder, not UTF-8, a duplicate key, an octal 010: named here
    from controller.config_overrides import blame, overridden, parse_overrides  # (it imports this module)

    overrides, typed = parse_overrides(overrides)
    try:
        return from_dict(overridden(d, overrides), world_size)
    except ConfigError as e:
        raise ConfigError(f"{blame(d, overrides, typed, world_size, str(e)) or path}: {e}") from None
