"""The run's own config sections (``model`` .. ``logging``): frozen, typed dataclasses, each
key's valid values declared on its field and its own checks in ``__post_init__``.

``controller.config`` builds them from the YAML (``build_section``: unknown keys, types and the
declared ranges) into the run's ``Config``; the sections owned by other components
(``engine``, ``trainer``, ``topology``, ``weight_sync``) are their own classes, built there too.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Literal

from controller import trackers
from controller.config_types import ConfigError, key_hint
from controller.modes import MODES
from controller.process_state import COLLECTIVE_TIMEOUT_S, MAX_COLLECTIVE_TIMEOUT_S, RPC_TIMEOUT_S
from controller.rpc import MAX_RPC_TIMEOUT_S
from workers.config_schema import SEEDS, Range, expand_path, ranged
from workers.types import GREEDY_BELOW, MAX_TEMPERATURE, MIN_SAMPLED_TEMPERATURE

PIPELINE_MODES = tuple(MODES)
# Every int / float key of a run section declares its valid values next to it (``ranged``),
# checked at load after the types (every float must also be finite: no .nan/.inf); a tuple's
# range applies to each value. docs/config.md lists the same.
TEMPERATURES = f"below {GREEDY_BELOW:g}: greedy; sampled from {MIN_SAMPLED_TEMPERATURE:g}, as both engines serve"


@dataclass(frozen=True)
class ModelSection:
    """``path``: HF folder of the policy. ``init``: when set and ``path`` has no model yet, a
    fresh model with these ``workers.model_config.ModelConfig`` fields is built there (quickstart)."""

    path: str = "runs/quickstart/model"
    init: dict | None = None

    def __post_init__(self):
        _path_key(self, "model", "path", "the Hugging Face model folder of the policy (config.json, "
                  "*.safetensors, tokenizer.json), or where model.init builds one")


# what a chat template is given by the run, not by tokenizer.chat_template_kwargs
TEMPLATE_OWN = {"messages": "the prompt's chat", "add_generation_prompt": "true for a prompt",
                "tools": "multi_turn.tools", "documents": "none"}


@dataclass(frozen=True)
class TokenizerSection:
    """The tokenizer is the model folder's (``tokenizer.json``, as Hugging Face). Prompts are
    formatted by the folder's chat template, else by ``prompt_template`` (``str.format`` with
    ``{prompt}``): set here, it overrides the folder's and is saved into a model built by
    ``model.init`` (its SFT warm start uses it too). ``chat_template_kwargs`` (verl's
    ``data.apply_chat_template_kwargs``): variables the chat template sees wherever it renders
    (prompts, multi-turn observations), e.g. ``{enable_thinking: false}`` for Qwen3."""

    prompt_template: str = ""
    chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        from workers.tokenizer import check_prompt_template

        _keyword_keys(self, "tokenizer", "chat_template_kwargs")
        taken = [k for k in self.chat_template_kwargs if k in TEMPLATE_OWN]
        if taken:
            raise ConfigError(f"tokenizer.chat_template_kwargs: {taken[0]!r} is set by the run itself "
                              f"({TEMPLATE_OWN[taken[0]]}); leave it out")
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
        _keyword_keys(self, "task", "kwargs")


@dataclass(frozen=True)
class PipelineSection:
    mode: str = "async_stream"
    minibatch_size: int = ranged(8, Range(1))  # samples per hand-over in ``minibatch`` mode
    # instance -> trainer sample stream: samples finishing within this window share one RPC
    stream_window_s: float = ranged(0.02, Range(0, 10, note="seconds"))
    # verl's trainer.balance_batch: groups go to the trainer ranks by expected tokens (longest first
    # to the least loaded rank), not by their index in the iteration (outbox.balance)
    balance_batch: bool = False

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
        _keyword_keys(self, "dispatch", "options")


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
        _keyword_keys(self, "ranker", "options")
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
    rpc_timeout_s: float = ranged(RPC_TIMEOUT_S, Range(0, MAX_RPC_TIMEOUT_S, open_lo=True,
                                                       note="seconds; torch RPC's int32 milliseconds bound it"))
    # how long a trainer rank's collectives (the gradient all-reduce) wait for a peer that is
    # alive but behind (a slower reward, more tokens); a lost peer is the heartbeat's to find
    collective_timeout_s: float = ranged(COLLECTIVE_TIMEOUT_S, Range(0, MAX_COLLECTIVE_TIMEOUT_S, open_lo=True,
                                                                     note="seconds; gloo's int64 nanoseconds bound it"))
    # test hook: add a waiting joiner at this iteration
    force_scale_out_at: int = ranged(-1, Range(-1, note="-1: never"))

    def __post_init__(self):
        if self.force_scale_out_at >= 0 and not self.elastic:  # it waited 10 minutes for a joiner it refuses
            raise ConfigError(f"placement.force_scale_out_at: {self.force_scale_out_at} adds a joining generation "
                              "instance, but placement.elastic is false (a colocated run's default): no process "
                              "may join; leave force_scale_out_at out or set elastic: true")


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
    # verl's val_only: evaluate the starting weights (a fresh run's, after any train.sft_steps, or
    # those of the checkpoint --resume names) on eval_prompts test prompts and stop: nothing
    # trained, no checkpoint written; logged at the step it resumed after (-1 fresh)
    eval_only: bool = False
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
        return bool(self.eval_every or self.eval_before_train or self.eval_only)


@dataclass(frozen=True)
class MultiTurnSection:
    """Multi-turn rollouts (verl's ``rollout.multi_turn``; docs/multi_turn.md): each assistant turn
    that ends in EOS goes to the environment ``env`` ("": single-turn; a built-in name of
    ``workers/tasks/envs``, or ``module:fn`` / ``file.py:fn``), whose observation is spliced into
    the response; ``train.max_tokens`` covers every turn and observation. ``tools``: a JSON / YAML
    file of OpenAI tool schemas the prompts show through the chat template ("": the env's
    ``TOOLS``, if any; ``workers/tasks/envs/tools.py``)."""

    env: str = ""
    tools: str = ""  # verl's tool_config_path (its tool_schema entries), or a list of schemas
    max_turns: int = ranged(4, Range(1))  # assistant turns (verl's max_assistant_turns)
    max_observation_tokens: int = ranged(256, Range(1))  # an observation's content, in tokens (verl's max_tool_response_length)
    # what of a longer one is kept (verl's tool_response_truncate_side): left its start, right its end, middle both
    observation_truncate_side: Literal["left", "middle", "right"] = "middle"
    workers: int = ranged(4, Range(1))  # environment calls at once per generation instance

    def __post_init__(self):
        _path_key(self, "multi_turn", "env")  # ~/envs.py:fn
        _path_key(self, "multi_turn", "tools")

    @property
    def on(self) -> bool:
        return bool(self.env)


@dataclass(frozen=True)
class LoggingSection:
    logdir: str = "runs/quickstart"
    timeline_every: int = ranged(5, Range(0, note="0: never"))  # Gantt figure to TensorBoard every K iterations
    progress: bool = True
    # trackers beside TensorBoard (verl's trainer.logger; one name or a list): controller/trackers.py
    trackers: tuple[trackers.TrackerName, ...] | trackers.TrackerName = ()
    project: str = "streamrl"  # verl's trainer.project_name
    experiment: str = ""  # verl's trainer.experiment_name; "": the run folder's name
    # verl's trainer.rollout_data_dir: each iteration's scored samples as JSON lines ("": none)
    rollout_data_dir: str = ""
    # verl's trainer.validation_data_dir: each evaluation's generations as JSON lines ("": none)
    validation_data_dir: str = ""
    # verl's trainer.log_val_generations: the first N generations of each evaluation to TensorBoard
    log_val_generations: int = ranged(0, Range(0, note="0: none"))

    def __post_init__(self):
        _path_key(self, "logging", "logdir", "the run's folder (logs, checkpoints), e.g. runs/NAME")
        _path_key(self, "logging", "rollout_data_dir")
        _path_key(self, "logging", "validation_data_dir")
        if self.rollout_data_dir and self.validation_data_dir and \
                os.path.realpath(self.rollout_data_dir) == os.path.realpath(self.validation_data_dir):
            raise ConfigError(f"logging.validation_data_dir: the same folder as logging.rollout_data_dir "
                              f"({self.rollout_data_dir}); both write <iteration>.jsonl there, one replacing the "
                              "other's: give each a folder of its own")
        if isinstance(self.trackers, str):  # `logger: wandb`, as verl takes it
            object.__setattr__(self, "trackers", (self.trackers,))
        why = trackers.missing(self.trackers)
        if why:
            raise ConfigError(f"logging.trackers: {why}")
        if "wandb" in self.trackers and not self.project.strip():
            raise ConfigError("logging.project: empty; wandb needs a project name (default: streamrl)")


def _keyword_keys(section, name: str, key: str) -> None:
    """A mapping passed on as keyword arguments has string keys: YAML 1.1 reads a bare ``on``,
    ``off``, ``yes``, ``no`` or a number as another type (a TypeError deep in the start before)."""
    value = getattr(section, key)
    bad = [k for k in value if not isinstance(k, str)] if isinstance(value, dict) else []
    if bad:
        raise ConfigError(f"{name}.{key}: key {bad[0]!r} ({type(bad[0]).__name__}) is not a name (YAML reads a bare "
                          "on / off / yes / no as a bool, digits as a number); quote it, e.g. 'on': ...")


def _path_key(section, name: str, key: str, required: str = "") -> None:
    """A path key of a section, expanded as a shell would (``expand_path``: ``~``, ``$VAR``);
    ``required``: what the key
    names, when it may not be empty (an empty one failed later, in the bootstrap)."""
    value = getattr(section, key)
    if not isinstance(value, str):
        return  # build_section names a wrong type
    if required and not value.strip():
        default = next(f.default for f in dataclasses.fields(section) if f.name == key)
        raise ConfigError(f"{name}.{key}: empty{f' ({value!r})' if value else ''}; give {required} (or leave the "
                          f"key out for its default, {default})")
    object.__setattr__(section, key, expand_path(value))
