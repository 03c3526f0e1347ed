"""The worker groups of a run: trainer ranks + SGS instances, created on their ranks by the
controller (``rpc.remote``), and the versioned weight push from trainer to instances.

Weight push paths, chosen per instance:
* colocated -- the instance copies the weights of the trainer object in its own process;
* weight-sync tree (``workers.weight_sync``: the run's ``weight_sync`` section and
  ``topology``, every trainer rank a root for its share of the buckets, sender/receiver over
  torch.distributed) for instances inside the static world;
* pulled over RPC for instances that joined later (outside the process group): the
  controller asks the instance to fetch the version from trainer rank 0 (``pull_weights``).
  The trainer never calls a generation instance: a joiner that dies mid-transfer fails only
  the controller's call, which the program turns into "instance lost" (re-dispatch), with
  ``weight_timeout_s``.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any

from controller.instance import GenerationInstance
from controller.rpc import Call, WorkerFailed, WorkerHandle, construct, create, settle, wait_all, waited
from controller.sgs import SGS, default_profile
from controller.trainer_rank import TrainerRank
from workers.weight_sync import WeightSyncConfig, wire_dtype


@dataclass
class World:
    trainers: list[WorkerHandle]
    sgs: SGS
    colocated: bool
    static_ranks: set[int] = field(default_factory=set)  # ranks inside the gloo/NCCL world
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # default: one datacenter
    weight_timeout_s: float = 60.0  # a pull that takes longer: the instance counts as lost
    # the prompts' tokenizer, which a multi-turn engine renders observations with (None: single-turn)
    tokenizer: Any = None
    _spec: list | None = None
    _described: tuple = ()  # (senders, receivers) of the last plan described on stderr

    def received(self, iteration: int) -> set[int]:
        out: set[int] = set()
        for ids in wait_all([t.call("received_ids", iteration) for t in self.trainers]):
            out.update(ids)
        return out

    def push_weights(self, version: int, only: list[WorkerHandle] | None = None) -> list[Call]:
        """Start pushing the trainer's current weights (``version``) to instances; returns the
        calls to wait on. Instances stage them and swap at their next iteration boundary."""
        targets = only if only is not None else self.sgs.handles
        if not targets:
            return []
        if self.colocated:
            return [h.call("load_local_trainer_weights", version) for h in targets]
        tree = [h for h in targets if h.rank in self.static_ranks]
        rest = [h for h in targets if h not in tree]
        calls = []
        if tree:
            # the trainer ranks are data-parallel replicas: each is a root for its share of
            # the buckets, so no one NIC carries the whole model
            senders = self.trainers
            if self._spec is None:  # in the engines' dtype: a bf16 engine is sent bf16, half of fp32
                # (an instance lost before the first push fails the query, naming it: a tree whose
                # receiver is gone stops the run anyway, docs/controller.md)
                dtypes = wait_all([h.call("weight_dtype") for h in tree])
                self._spec = senders[0].call("tensor_spec", wire_dtype(dtypes)).wait()
            plan = self.sync.plan([t.rank for t in senders], [h.rank for h in tree], self._spec)
            if (plan.senders, plan.receivers) != self._described:
                self._described = (plan.senders, plan.receivers)
                shape = f" ({self.sync.tree_shape})" if plan.kind != "naive" else ""  # naive: a star from each root
                print(f"[controller] weight sync: {plan.kind} plan{shape}, {len(plan.buckets)} "
                      f"buckets of <= {plan.bucket_bytes} B, {plan.total_bytes} B from roots "
                      f"{plan.bytes_by_root()} to {list(plan.receivers)}", file=sys.stderr, flush=True)
            calls += [t.call("push_weights", plan, version) for t in senders if t.rank in plan.senders]
            calls += [h.call("receive_weights", plan) for h in tree]
        t = self.weight_timeout_s
        calls += [h.call("pull_weights", version, t, timeout=t + 5.0) for h in rest]
        return calls

    def drain_spans(self) -> list:
        """Spans of every worker; a generation instance that vanished meanwhile is skipped
        (the SGS notices and re-dispatches when its ``generate`` fails)."""
        out = []
        for c in [h.call("drain_spans") for h in self.trainers + self.sgs.handles]:
            try:
                out += c.wait()
            except WorkerFailed as e:
                if not (e.lost and c.handle.role == "generation"):
                    raise
        return out


def build_world(cfg, model_dir: str, eos_ids: list[int] | None, static_ranks: set[int],
                dispatcher, tokenizer=None) -> World:
    """Create TrainerRank objects (DP group) and GenerationInstances on the placement's ranks.
    ``tokenizer``: the one the controller encodes prompts with (its chat template, tools and
    template variables); a multi-turn run's engines render observations with it."""
    p = cfg.placement
    colocated = p.colocated or cfg.pipeline.mode == "colocated"
    timeout = p.rpc_timeout_s
    futs = [construct(r, TrainerRank, (r, list(p.trainer), cfg.trainer, model_dir, cfg.task.name,
                                       dict(cfg.task.kwargs), p.collective_timeout_s,
                                       cfg.logging.rollout_data_dir), timeout)
            for r in sorted(p.trainer)]
    trainers = settle(futs, "trainer", timeout)
    tokenizer = tokenizer if cfg.multi_turn.env else None
    gen_futs = [construct(r, GenerationInstance, (r, cfg.engine, model_dir, eos_ids, cfg.multi_turn, tokenizer),
                          timeout)
                for r in sorted(p.generation)]
    instances = settle(gen_futs, "generation", timeout)
    world = World(trainers, None, colocated, set(static_ranks), cfg.weight_sync,  # type: ignore[arg-type]
                  weight_timeout_s=float(timeout), tokenizer=tokenizer)
    world.sgs = SGS(dispatcher, world.received, cfg.train.seed)
    wait_all([h.call("connect", [t.rref for t in trainers]) for h in instances])
    for h in instances:
        world.sgs.add(h, _profile(cfg))
    return world


def check_engine(engine, ranks, timeout: float) -> None:
    """Asks each generation rank whether it can run ``engine`` (workers.generation.support: CUDA
    for ``engine.device: cuda``, vLLM for ``backend: vllm``, your own engine's module for
    ``backend: module:Name``, triton for ``attention_backend: triton``) before any engine is
    built; their hosts may differ from the controller's. The first problem is one ConfigError,
    not a traceback from each instance."""
    import torch.distributed.rpc as rpc

    from controller.config import ConfigError
    from workers.generation.support import engine_problem

    futs = {r: rpc.rpc_async(f"worker{r}", engine_problem, args=(engine, f"rank {r} (generation)"),
                             timeout=timeout) for r in sorted(ranks)}
    for r, fut in futs.items():
        problem = waited(fut, r, "generation", "engine_problem")
        if problem:
            raise ConfigError(problem)


class ModelMismatch(ValueError):
    """A joiner's model folder (``model.path`` on its host) holds another model than the run's."""


def model_signature(model_dir: str) -> dict:
    """The folder's model as far as its weights' shapes and meaning go, in a spelling-free form:
    sizes, the head size (``head_dim`` written out or not), biases, norm epsilon, tying, and RoPE
    (theta, and the scaling's kind and parameters: ``{"rope_type": "default"}`` is none, ``type``
    and ``rope_type`` one key). Not the context length (checked apart, ``ContextNeed``) nor the
    special token ids (the controller's)."""
    import json
    from pathlib import Path

    from workers.model_config import ROPE_KEYS, ModelConfig, rope_kind

    path = Path(model_dir) / "config.json"
    if not path.is_file():  # a joiner's: started from another folder, a relative model.path is another folder
        raise FileNotFoundError(f"model.path {model_dir!r}: no config.json at {path.resolve()} (a relative "
                                "model.path is read from this process's working directory: start it from the job's "
                                "folder, or give model.path as an absolute path)")
    c = ModelConfig.from_hf(json.loads(path.read_text(encoding="utf-8")), path)
    kind = rope_kind(c.rope_scaling)
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.dim_head, "rms_norm_eps": c.rms_norm_eps,
            "qkv_bias": c.has_qkv_bias, "o_bias": c.has_o_bias, "mlp_bias": c.mlp_bias,
            "tie_word_embeddings": c.tie_word_embeddings, "rope_theta": float(c.rope_theta),
            "rope_scaling": None if kind == "default" else
            {"rope_type": kind, **{k: float(c.rope_scaling[k]) for k in ROPE_KEYS.get(kind, ())}}}


def add_instance(world: World, cfg, rank: int, model_dir: str, eos_ids, version: int) -> WorkerHandle | None:
    """Scale out: create an instance on a joined rank, have it pull the current weights, add
    it. A joiner that dies before it holds them is not added (returns None); nothing else
    (no trainer, no collective) has depended on it yet. One whose folder holds another model
    (``model_signature``: layers, sizes, RoPE, ...) is refused before its engine is built: the
    pull covers the trainer's tensors only, and a deeper model kept its own extra layers and
    trained the run on their samples (review, s54)."""
    from controller.rpc import call_on

    ours = model_signature(model_dir)
    try:
        theirs = call_on(rank, "generation", model_signature, (model_dir,), timeout=cfg.placement.rpc_timeout_s)
        differ = {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}
        if differ:
            raise ModelMismatch(f"joiner rank {rank}'s model folder {model_dir} holds another model than this "
                                "run's: " + ", ".join(f"{k} {t!r} (the run's: {o!r})" for k, (o, t) in differ.items()))
        h = create(rank, "generation", GenerationInstance, rank, cfg.engine, model_dir, eos_ids,
                   cfg.multi_turn, world.tokenizer, timeout=cfg.placement.rpc_timeout_s)
        h.call("connect", [t.rref for t in world.trainers]).wait()
        wait_all(world.push_weights(version, only=[h]))
        h.call("hold_weights", version).wait()
    except WorkerFailed as e:
        if not (e.lost and e.role == "generation"):
            raise
        print(f"[world] joiner rank {rank} lost before it held weights v{version}: {str(e).splitlines()[0]}",
              file=sys.stderr, flush=True)
        return None
    world.sgs.add(h, _profile(cfg))
    return h


def _profile(cfg):
    from controller.scheduling import PTLProfile

    e = cfg.engine
    kv_tokens = e.total_blocks * e.block_size
    if cfg.dispatch.profile:  # its measured times; the batch cap and the KV the engine holds to
        prof = PTLProfile.load(cfg.dispatch.profile)
        if (prof.kv_tokens, prof.block_size) != (kv_tokens, e.block_size):
            # the dispatchers' batch caps come from the KV: a profile measured on a smaller
            # engine capped a 64-sequence engine at 5 (flows review, s59)
            print(f"[sgs] dispatch.profile {cfg.dispatch.profile}: measured on an engine with {prof.kv_tokens} KV "
                  f"tokens in blocks of {prof.block_size}; this run's hold {kv_tokens} in blocks of {e.block_size} "
                  "(engine.kv_cache_tokens, engine.block_size): its step times are used with this run's KV",
                  file=sys.stderr, flush=True)
        return dataclasses.replace(prof, max_batch_size=min(prof.max_batch_size or e.max_batch_size, e.max_batch_size),
                                   kv_tokens=kv_tokens, block_size=e.block_size)
    return default_profile(e.max_batch_size, kv_tokens, e.block_size)
