"""Trainer checkpoints, written atomically (temp dir beside the target, then renamed).

Layout: ``model/`` (HF format: config.json, model.safetensors, tokenizer files),
``critic.safetensors`` (when a critic is used), ``trainer_state.pt`` (optimizer, scheduler,
RNG states, weight version, iteration). The reference model is not saved: it is the
``model_dir`` the worker was built from."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.model import load_state, replace_dir, save_pretrained
from workers.trainer.schedule import lr_lambda

if TYPE_CHECKING:
    from workers.trainer.worker import TrainerWorker

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STATE_FILE = "trainer_state.pt"


def save(w: "TrainerWorker", path: str) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
    extra = [Path(w.model_dir) / f for f in TOKENIZER_FILES if (Path(w.model_dir) / f).exists()]
    save_pretrained(w.actor, tmp / "model", extra_files=extra)
    if w.critic is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in w.critic.state_dict().items()
                   if "rotary_emb" not in k}, str(tmp / "critic.safetensors"))
    state = {
        "optimizer": w.optimizer.state_dict(),
        "scheduler": w.scheduler.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "version": w.version,
        "iteration": w.iteration,
        "algorithm": w.cfg.algorithm,
    }
    torch.save(state, tmp / STATE_FILE)
    replace_dir(tmp, path)
    return path


def load(w: "TrainerWorker", path: str) -> None:
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / STATE_FILE).exists() or not (path / "model").is_dir():
        raise FileNotFoundError(f"{path}: not a trainer checkpoint (needs model/ and {STATE_FILE})")
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    if state["algorithm"] != w.cfg.algorithm:
        raise ValueError(f"{path}: checkpoint is for algorithm {state['algorithm']!r}, trainer runs {w.cfg.algorithm!r}")
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
    w.optimizer.load_state_dict(state["optimizer"])
    w.scheduler.load_state_dict(state["scheduler"])
    # the lr of the step it resumes at, under this run's schedule: a run continued with more
    # iterations has a longer schedule (total_steps follows them), and the saved lr was the old
    # schedule's (its last step: 0 for cosine / linear)
    lam = lr_lambda(w.cfg)
    for group, base in zip(w.optimizer.param_groups, w.scheduler.base_lrs):
        group["lr"] = base * lam(w.scheduler.last_epoch)
    w.scheduler._last_lr = [g["lr"] for g in w.optimizer.param_groups]
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])
    w._version = int(state["version"])
    w.iteration = int(state["iteration"])
