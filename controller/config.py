"""Run configuration: YAML -> frozen, typed dataclasses, validated once at load.

Every key is checked here, before any process does work: an unknown key, a wrong type or an
impossible placement raises ``ConfigError`` naming the key (``placement.trainer[1]: rank 5 >=
world size 3``). Sections owned by other components are converted into their own config
classes (``engine`` -> ``EngineConfig``, ``trainer`` -> ``TrainerConfig``, ``topology`` ->
``Topology``) so their validation runs at load too. The run's own sections (``model`` ..
``logging``) are ``config_sections``; each key's own checks (type, range, name) are
``config_types``; the checks across keys (placement, modes, registries) ``config_checks``.
This module holds the whole ``Config``, its loading (``load_config``, ``from_dict``) and the
trainer keys that follow the train section unless set.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.config_checks import validate
from controller.config_sections import (PIPELINE_MODES, TEMPERATURES, DispatchSection, LoggingSection, ModelSection,
                                        MultiTurnSection, PipelineSection, PlacementSection, RankerSection, TaskSection,
                                        TokenizerSection, TrainSection)
from controller.config_types import ConfigError, build_section, key_hint
from controller.config_yaml import read_config_file
from workers.config_schema import DERIVED, key_fields
from workers.generation.config import EngineConfig
from workers.trainer.config import TrainerConfig
from workers.types import GREEDY_BELOW
from workers.weight_sync import Topology, WeightSyncConfig

# the names other modules import from here (the sections are defined in config_sections)
__all__ = ["Config", "ConfigError", "DispatchSection", "LoggingSection", "ModelSection", "MultiTurnSection",
           "OWNED_SECTIONS", "PIPELINE_MODES", "PipelineSection", "PlacementSection", "RankerSection",
           "TEMPERATURES", "TaskSection", "TokenizerSection", "TrainSection", "from_dict", "load_config"]

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
    multi_turn: MultiTurnSection = field(default_factory=MultiTurnSection)
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
        engine=build_section(EngineConfig, "engine", d.get("engine")),
        trainer=trainer,
        pipeline=build_section(PipelineSection, "pipeline", d.get("pipeline")),
        dispatch=build_section(DispatchSection, "dispatch", d.get("dispatch")),
        ranker=build_section(RankerSection, "ranker", d.get("ranker")),
        placement=build_section(PlacementSection, "placement", _colocated_static(d.get("placement"), d.get("pipeline"))),
        topology=topology,
        weight_sync=_weight_sync(d.get("weight_sync"), topology),
        train=train,
        multi_turn=build_section(MultiTurnSection, "multi_turn", d.get("multi_turn")),
        logging=build_section(LoggingSection, "logging", d.get("logging")),
        follows=tuple(k for k in FOLLOWED if k not in explicit),
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


# trainer keys that follow the train section unless the trainer section sets them (_norm_follows,
# _trainer_from_train): the run's record leaves them out, so it loads to the same Config
FOLLOWED = ("total_steps", "loss_scale_factor", "max_response_tokens", "temperature", "seed",
            "recompute_old_logprobs")


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
    """Trainer settings that follow the run unless the trainer section sets them: the seed
    (``train.seed``), the temperature its log-probs are taken at (the samples' ``train.temperature``; greedy samples
    carry T = 1 log-probs; checked when set) and ``recompute_old_logprobs`` when the rollout
    filters tokens (``train.top_k`` / ``top_p``; checked when set). The LR schedule's length
    ``total_steps`` follows ``train.iterations`` before the section is built (``_norm_follows``)."""
    rollout = train.temperature if train.temperature >= GREEDY_BELOW else 1.0
    if "temperature" in explicit and trainer.temperature != rollout:
        raise ConfigError(f"trainer.temperature: {trainer.temperature} differs from the rollout's "
                          f"train.temperature {train.temperature} (the PPO ratio, KL and entropy must be taken "
                          "at the sampling temperature); leave it out, it is taken from train.temperature")
    cap = max(train.max_tokens, 1)
    if "max_response_tokens" in explicit and trainer.max_response_tokens != cap:  # (review, s55)
        raise ConfigError(f"trainer.max_response_tokens: {trainer.max_response_tokens} differs from the run's "
                          f"response cap train.max_tokens {train.max_tokens} (the overlong penalty counts from "
                          "the cap: past it the penalty never applies, below it the response is cut first); "
                          "leave it out, it is taken from train.max_tokens")
    follow = {"temperature": rollout, "seed": train.seed}  # train.seed: the run's one seed (the critic's head,
    # LoRA's init, the mini-batch shuffle kept trainer.seed's default 0 whatever it said: review, s51)
    if train.top_k > 0 or train.top_p < 1.0:
        # the sampler's log-probs are of the filtered distribution; the trainer's are not
        if trainer.rollout_bypass:
            raise ConfigError("trainer.rollout_bypass: takes the samples' log-probs as the old policy, and with "
                              "train.top_k / train.top_p they are of the filtered distribution, the trainer's of the "
                              "full one (the ratio would not be 1 on-policy); leave rollout_bypass out (the decoupled "
                              "mode recomputes the old log-probs) or the rollout filters")
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
    if not isinstance(d, dict):  # (said by from_dict too, but a --set would index it first)
        raise ConfigError(f"{path}: config: expected a mapping at top level, got {type(d).__name__}")
    try:
        return from_dict(overridden(d, overrides), world_size)
    except ConfigError as e:
        raise ConfigError(f"{blame(d, overrides, typed, world_size, str(e)) or path}: {e}") from None
