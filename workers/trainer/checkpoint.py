"""Trainer checkpoints, written atomically (temp dir beside the target, then renamed).

Layout: ``model/`` (HF format: config.json, model.safetensors, and the source model folder's other
files: tokenizer, chat template, generation_config.json; ``carried_files``),
``critic.safetensors`` (when a critic is used), ``checksums.json`` (every file's CRC-32),
``trainer_state.pt`` (optimizer, scheduler, each data-parallel rank's RNG states, weight version,
iteration, the reward KL coefficient as adapted: trainer.kl_target),
``trainer.json`` (algorithm, critic: what ``check`` reads without loading tensors). The reference
model is not saved: it is the ``model_dir`` the worker was built from."""
from __future__ import annotations

import contextlib
import json
import logging
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workers.atomic import atomic_dir, file_digest, folder_digests
from workers.model import load_state, save_pretrained
from workers.trainer import optimizer
from workers.trainer.custom_advantage import canonical, identity
from workers.trainer.lora import check_adapter, target_names
from workers.trainer.schedule import apply_schedule

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker

log = logging.getLogger("streamrl.trainer")
# what of the source model folder is not carried into a checkpoint's model/: config.json and the
# weights are written anew; other weight formats and hidden files are left out
NOT_CARRIED = ("config.json",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".ot",
                   ".safetensors.index.json", ".bin.index.json")
CARRIED_DIRS = ("additional_chat_templates",)  # transformers' named chat templates
STATE_FILE = "trainer_state.pt"
META_FILE = "trainer.json"
ADAPTER_DIR = "adapter"  # LoRA runs: the PEFT adapter folder
SUMS_FILE = "checksums.json"  # each file's CRC-32 at save, checked by check()
# the ModelConfig fields that decide the tensors' names and shapes
SHAPE_KEYS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "dim_head", "has_qkv_bias", "has_o_bias", "mlp_bias",
              "tie_word_embeddings")


def rng_states(w: "TrainerWorker") -> list[tuple]:
    """Each data-parallel rank's (CPU, CUDA) RNG states, in rank order: an all-gather with
    several ranks (every rank calls it). Each rank draws its own numbers (clip_cov's choice of
    tokens), so a resume gives each rank its own back, not rank 0's."""
    mine = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    if w.world_size == 1:
        return [mine]
    every: list = [None] * w.world_size
    # NCCL stages the pickled states on the calling thread's current GPU (as group_filter.gather_over)
    with torch.cuda.device(w.device) if w.device.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(every, mine, group=w.group)
    return every


def save(w: "TrainerWorker", path: str, optimizer_state: dict, rng: list[tuple] | None = None) -> Path:
    """``optimizer_state``: the whole optimizer state (``optimizer.full_state_dict``: a sharded
    optimizer's own ``state_dict()`` is whatever its last consolidation gathered); ``rng``:
    ``rng_states`` (None: this process's alone)."""
    rng = rng or rng_states(w)
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_dir(path) as tmp:  # a full disk, an unwritable folder: no half-written copy left taking space
        # the merged weights (LoRA folded in): model/ is a whole model, for the engines or an export
        # each tensor to the CPU as it is merged: no second copy of the model on the device
        save_pretrained(w.actor, tmp / "model", extra_files=carried_files(w.model_dir),
                        state={k: v.detach().cpu() for k, v in w.named_weights()})
        if w.lora is not None:  # the adapters alone, as PEFT writes them: what a resume trains on
            w.lora.save(tmp / ADAPTER_DIR, base_model=str(Path(w.model_dir).resolve()))
        if w.critic is not None:
            save_file({k: v.detach().contiguous().cpu() for k, v in w.critic.state_dict().items()
                       if "rotary_emb" not in k}, str(tmp / "critic.safetensors"))
        state = {
            "optimizer": optimizer_state,
            "scheduler": w.scheduler.state_dict(),
            "actor_steps": w.actor_steps,
            "rng_cpu": rng[0][0],  # rank 0's, what a resume on another number of ranks gives every rank
            "rng_cuda": rng[0][1],
            "rng_ranks": rng,
            "version": w.version,
            "iteration": w.iteration,
            "algorithm": canonical(w.cfg.algorithm),
            # beta of kl_mode reward as adapted so far (trainer.kl_target); None when fixed: a
            # resume that turns kl_target on starts from its own kl_coef
            "kl_coef": w.kl.value if w.cfg.kl_target > 0 else None,
        }
        torch.save(state, tmp / STATE_FILE)
        spec, digest = identity(w.cfg.algorithm)
        (tmp / META_FILE).write_text(json.dumps({"algorithm": spec, "algorithm_sha1": digest,
                                                 "critic": w.critic is not None, "version": w.version,
                                                 "lora_rank": w.cfg.lora_rank, "checksums": True}))
        (tmp / SUMS_FILE).write_text(json.dumps(folder_digests(tmp, "crc32"), indent=0))
    return path


def carried_files(model_dir: str | Path) -> list[Path]:
    """The files of ``model_dir`` a checkpoint's ``model/`` copies, so that the exported model
    tokenizes, formats chats and generates as the source did: every top-level file but config.json
    and the weights (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    added_tokens.json, chat_template.jinja, generation_config.json with its extra EOS ids and
    sampling defaults, vocab.json / merges.txt / tokenizer.model, README, ...), and the
    ``additional_chat_templates/`` folder. Hidden files and other folders are left out."""
    folder = Path(model_dir)
    out = []
    for f in sorted(folder.iterdir()):
        if f.name.startswith("."):
            continue
        if f.is_dir():
            if f.name in CARRIED_DIRS:
                out.append(f)
        elif f.is_file() and f.name not in NOT_CARRIED and not f.name.endswith(WEIGHT_SUFFIXES):
            out.append(f)
    return out


def check(path: str | Path, model_dir: str | Path, algorithm: str, critic: bool, lora_rank: int = 0,
          lora_alpha: float = 16.0, lora_targets: tuple[str, ...] = ()) -> None:
    """What can be checked of a trainer checkpoint without loading its tensors: every file is
    there and whole (a safetensors header that covers its file, a zip with its directory, the
    JSON files parse), its model has the tensors of ``model_dir``'s (config.json: the fields
    that decide names and shapes), and it was trained by ``algorithm`` with(out) a critic.
    Raises FileNotFoundError / ValueError naming the file and what is wrong."""
    from safetensors import safe_open

    from workers.model import ModelConfig

    path = Path(path)
    if not (path / STATE_FILE).exists() or not (path / "model").is_dir():
        raise FileNotFoundError(f"{path}: not a trainer checkpoint (needs model/ and {STATE_FILE})")

    def damaged(f: Path, e: Exception) -> ValueError:
        return ValueError(f"{f}: unreadable, the checkpoint is damaged ({e})")

    def read_json(f: Path) -> dict:
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise damaged(f, e) from None

    def model_config(f: Path) -> ModelConfig:
        d = read_json(f)
        try:
            return ModelConfig.from_hf(d)
        except (KeyError, TypeError, ValueError) as e:
            raise damaged(f, e) from None

    # every file the save listed is there before any is read: a missing trainer.json was taken
    # for an older checkpoint's (none) and refused as "trained without LoRA"
    sums = read_json(path / SUMS_FILE) if (path / SUMS_FILE).exists() else {}
    for name in sums:
        if not (path / name).is_file():
            raise damaged(path / name, FileNotFoundError("missing"))
    meta = read_json(path / META_FILE) if (path / META_FILE).exists() else {}  # older checkpoints have none
    if meta.get("checksums") and not sums:  # (checkpoints of before session 50 do not say)
        raise damaged(path / SUMS_FILE, FileNotFoundError("missing: the save wrote one"))
    spec, digest = identity(algorithm)
    if canonical(meta.get("algorithm", algorithm)) != spec:
        raise ValueError(f"{path}: checkpoint is for trainer.algorithm {meta['algorithm']!r}, this run's is "
                         f"{algorithm!r}")
    if meta.get("algorithm_sha1") and digest and meta["algorithm_sha1"] != digest:
        log.warning("%s: trainer.algorithm %s has changed since this checkpoint was saved (its file's SHA-1 "
                    "differs); resuming with the file as it is now", path, spec)
    if meta.get("critic", critic) != critic:
        raise ValueError(f"{path}: checkpoint was trained {'with' if meta['critic'] else 'without'} a critic, "
                         f"this run's trainer {'has' if critic else 'has none'}")

    saved_rank = meta.get("lora_rank", 0)
    if saved_rank != lora_rank:
        said = {0: "without LoRA"}
        raise ValueError(f"{path}: checkpoint was trained {said.get(saved_rank, f'with LoRA of rank {saved_rank}')}, "
                         f"this run's trainer.lora_rank is {lora_rank}"
                         + (" (its model/ holds the merged weights: use it as model.path to train it anew)"
                            if saved_rank and not lora_rank else ""))
    if lora_rank and not (path / ADAPTER_DIR / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"{path / ADAPTER_DIR}: the LoRA adapters are missing")
    mine, saved = model_config(Path(model_dir) / "config.json"), model_config(path / "model" / "config.json")
    diff = [f"{k} {getattr(saved, k)} (this run: {getattr(mine, k)})" for k in SHAPE_KEYS
            if getattr(saved, k) != getattr(mine, k)]
    if diff:
        raise ValueError(f"{path}/model is another model than this run's model.path {model_dir}: " + ", ".join(diff))
    tensors = sorted((path / "model").glob("*.safetensors"))
    if not tensors:
        raise FileNotFoundError(f"{path}/model: no *.safetensors files")
    if lora_rank:
        tensors.append(path / ADAPTER_DIR / "adapter_model.safetensors")
    if critic:
        tensors.append(path / "critic.safetensors")
        if not tensors[-1].exists():
            raise FileNotFoundError(f"{tensors[-1]}: the trainer uses a critic (trainer.algorithm {algorithm}) "
                                    "but the checkpoint has none")
    for f in tensors:
        try:
            with safe_open(str(f), "pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors' own error type
            raise damaged(f, e) from None
    try:
        zipfile.ZipFile(path / STATE_FILE).close()
    except (OSError, zipfile.BadZipFile) as e:
        raise damaged(path / STATE_FILE, e) from None
    # bytes changed inside a file (a disk or copy error): safetensors' header and torch.load
    # take it without a word; the sums written at save do not (checkpoints before them have none)
    for name, want in sums.items():
        f = path / name
        got = file_digest(f, "crc32")
        if got != want:
            raise damaged(f, ValueError(f"CRC-32 {got}, written as {want}: its bytes changed since the save"))
    if lora_rank:
        check_adapter(path / ADAPTER_DIR, path / "model", Path(model_dir), lora_rank, lora_alpha, lora_targets)

def load(w: "TrainerWorker", path: str) -> None:
    from safetensors.torch import load_file

    path = Path(path)
    check(path, w.model_dir, w.cfg.algorithm, w.critic is not None, w.cfg.lora_rank, w.cfg.lora_alpha,
          target_names(w.cfg.lora_target_modules))
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file, whatever torch's error
        raise ValueError(f"{path / STATE_FILE}: unreadable, the checkpoint is damaged ({e})") from None
    if canonical(state["algorithm"]) != canonical(w.cfg.algorithm):
        raise ValueError(f"{path}: checkpoint is for algorithm {state['algorithm']!r}, trainer runs {w.cfg.algorithm!r}")
    if w.lora is not None:  # the base stays model_dir's (frozen); model/ is it merged with these
        w.lora.load(path / ADAPTER_DIR)
    else:
        weights = {k: v for k, v in load_state(path / "model").items() if "rotary_emb" not in k}
        missing, unexpected = w.actor.load_state_dict(weights, strict=False)
        missing = [m for m in missing if "rotary_emb" not in m and not (
            w.actor.config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{path}/model does not match the trainer's model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    if w.critic is not None:
        critic_file = path / "critic.safetensors"
        if not critic_file.exists():
            raise FileNotFoundError(f"{critic_file}: the trainer uses a critic but the checkpoint has none")
        w.critic.load_state_dict(load_file(str(critic_file)))
    # the optimizer's hyper-parameters are this run's (its state_dict holds the saved run's): a run
    # resumed with another trainer.lr / critic_lr / betas / weight_decay / adam_eps uses them
    hyper = [{"initial_lr": g["initial_lr"], **{k: g[k] for k in ("betas", "eps", "weight_decay")}}
             for g in w.optimizer.param_groups]
    optimizer.load_state_dict(w.optimizer, state["optimizer"])
    w.scheduler.load_state_dict(state["scheduler"])
    for group, h in zip(w.optimizer.param_groups, hyper):
        group.update(h)
    w.scheduler.base_lrs = [h["initial_lr"] for h in hyper]
    # the schedule steps that updated the actor (trainer.critic_warmup's are not; a checkpoint of
    # before session 49, which had no warm-up, holds none: every step did)
    w.actor_steps = int(state.get("actor_steps", w.scheduler.last_epoch))
    # the lr of the step it resumes at, under this run's schedule: a run continued with more
    # iterations has a longer schedule (total_steps follows them), and the saved lr was the old
    # schedule's (its last step: 0 for cosine / linear)
    apply_schedule(w)
    ranks = state.get("rng_ranks")  # each rank its own (before session 50: rank 0's alone)
    cpu, cuda = ranks[w.rank] if ranks and len(ranks) == w.world_size else (state["rng_cpu"], state["rng_cuda"])
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    w._version = int(state["version"])
    w.iteration = int(state["iteration"])
    if w.cfg.kl_target > 0 and state.get("kl_coef") is not None:  # an adapted beta goes on from where it was;
        w.kl.value = float(state["kl_coef"])  # a fixed one is this run's trainer.kl_coef
