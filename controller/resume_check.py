"""``--resume``: the checkpoint a run resumes from, found and checked before any trainer loads it.

A damaged file, or a checkpoint of another model / algorithm / LoRA shape, is one
``ConfigError`` naming ``--resume``; where the checkpoint before it would resume, the error says
so. A path with no checkpoint yet (the first start of a ``torchrun --max-restarts`` job) starts
fresh, said on stderr.
"""
from __future__ import annotations

import sys
from pathlib import Path

from controller import checkpoint as ckpt
from controller.config import ConfigError


def checked_resume(resume: str, cfg, model_dir: str):
    """``(checkpoint folder, its controller state)``, or None where ``resume`` holds none yet."""
    found = ckpt.find(resume, say_newer=True)
    if found is None:
        where = "does not exist" if not Path(resume).exists() else "holds no checkpoint"
        print(f"[controller] --resume {resume}: the path {where} yet; starting fresh", file=sys.stderr, flush=True)
        return None
    try:  # a damaged file or another model / algorithm: one line, before the trainers load it
        return found, _checked(found, cfg, model_dir)
    except (OSError, ValueError) as e:
        older = ckpt.previous(found)
        try:  # offered only when it would resume: a config the run's checkpoints all refuse is not damage
            ok = older is not None and _checked(older, cfg, model_dir) is not None
        except (OSError, ValueError):
            ok = False
        raise ConfigError(f"--resume {resume}: {e}"
                          + (f"; the previous checkpoint, {older}, is complete: --resume {older}" if ok else "")
                          ) from None


def _checked(c: Path, cfg, model_dir: str):
    from workers.trainer.checkpoint import check
    from workers.trainer.lora import target_names

    t = cfg.trainer
    state = ckpt.load_state(c)
    check(c / "trainer", model_dir, t.algorithm, t.use_critic, t.lora_rank, t.lora_alpha,
          target_names(t.lora_target_modules))
    if cfg.ranker.kind != "none" and (c / "ranker" / "meta.json").exists():  # updated online
        import ranker  # damaged, it failed the run after the trainers loaded, blaming a ranker --set

        ranker.load(c / "ranker")
    return state
