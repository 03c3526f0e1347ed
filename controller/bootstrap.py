"""Model folder set-up before the RL program starts (runs on the first trainer rank, so the
controller never holds weights): when ``model.path`` has no model and ``model.init`` is given,
build a tokenizer + tiny Qwen2-architecture model from scratch and SFT-warm-start it
(``workers.trainer.bootstrap.build_model_dir``)."""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path


def ensure_model(model_path: str, init: dict | None, task_name: str, task_kwargs: dict, sft_steps: int,
                 sft_lr: float, seed: int, prompt_template: str | None = None) -> dict:
    """Returns {"path", "built", "seconds", "sft"}; raises naming the key when nothing can be done."""
    path = Path(model_path)
    if (path / "config.json").exists():
        return {"path": str(path), "built": False, "seconds": 0.0, "sft": {}}
    if init is None:
        raise FileNotFoundError(f"model.path: {path} has no config.json and model.init is not set "
                                "(give an HF model folder, or model.init to build a tiny model)")
    import torch

    from workers.model import ModelConfig
    from workers.tasks.registry import make_task
    from workers.trainer.bootstrap import TINY, build_model_dir

    from workers.config_schema import build_section

    # typed as the preflight checked it: a "1e-5" from a caller's own YAML was built as text
    mcfg = build_section(ModelConfig, "model.init", {**asdict(TINY), **init})
    torch.manual_seed(seed)
    t0 = time.time()
    print(f"[bootstrap] building {path} (tokenizer + model from scratch, SFT {sft_steps} steps)",
          file=sys.stderr, flush=True)
    _, sft = build_model_dir(path, make_task(task_name, **task_kwargs), mcfg, sft_steps=sft_steps,
                             sft_lr=sft_lr, seed=seed, prompt_template=prompt_template,
                             log_every=max(1, sft_steps // 10))  # streamrl.sft's lines: every tenth
    seconds = time.time() - t0
    loss = f", SFT loss {sft.losses[0]:.3f} -> {sft.losses[-1]:.3f}" if sft.losses else ""
    print(f"[bootstrap] built {path} in {seconds:.1f} s{loss}", file=sys.stderr, flush=True)
    return {"path": str(path), "built": True, "seconds": seconds,
            "sft": {"steps": len(sft.losses), **({"loss_first": sft.losses[0], "loss_last": sft.losses[-1]}
                                                 if sft.losses else {})}}
