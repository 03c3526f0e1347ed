"""Shared helpers of the multi-process controller tests: a tiny model folder, a run config,
``torchrun`` of controller/main.py, readers of its outputs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from workers.weight_sync.localrun import free_port  # noqa: F401 (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
TASK = {"kind": "running_sum", "min_terms": 2, "max_terms": 4, "num_train": 64, "num_test": 16}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from workers.model import ModelConfig
    from workers.tasks.registry import make_task
    from workers.trainer.bootstrap import build_model_dir

    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("tiny") / "model"
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    build_model_dir(d, make_task("synthetic", **TASK), cfg, sft_steps=0)
    return str(d)


def write_config(tmp_path, model_dir, **over) -> Path:
    cfg = {
        "model": {"path": model_dir},
        "task": {"name": "synthetic", "kwargs": TASK},
        "engine": {"max_batch_size": 16, "kv_cache_tokens": 4096, "device": "cpu"},
        "trainer": {"algorithm": "grpo", "lr": 1e-3, "max_tokens_per_microbatch": 256},
        "pipeline": {"mode": "async_stream"},
        "placement": {"generation": [1], "trainer": [2], "rpc_timeout_s": 60},
        "train": {"iterations": 3, "batch_prompts": 4, "group_size": 2, "max_tokens": 8, "eval_every": 2,
                  "eval_prompts": 4},
        "logging": {"logdir": str(tmp_path / "run"), "timeline_every": 2, "progress": False},
    }
    for dotted, v in over.items():
        sec, key = dotted.split("__")
        cfg.setdefault(sec, {})[key] = v
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def torchrun(config: Path, nproc: int = 3, extra=(), timeout: float = 180, stdin: str | None = None,
             torchrun_args=(), c10d: bool = False) -> subprocess.CompletedProcess:
    """``c10d``: torchrun's c10d rendezvous (a fresh store per restart attempt), else a static port."""
    rdzv = (["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"] if c10d
            else ["--master-port", str(free_port())])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           *rdzv, *torchrun_args, str(ROOT / "controller/main.py"),
           "--config", str(config), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, input=stdin)


def last_json(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out
    return json.loads(lines[-1])


def iterations(logdir) -> list[dict]:
    return [json.loads(ln) for ln in (Path(logdir) / "iterations.jsonl").read_text().splitlines()]


class LocalRRef:
    """Stands in for an RRef: ``rpc_async().method(*args)`` runs here, as a finished future."""

    def __init__(self, obj):
        self.obj = obj

    def rpc_async(self, timeout=None):
        return self

    def __getattr__(self, name):
        def call(*args):
            fut = torch.futures.Future()
            try:
                fut.set_result(getattr(self.obj, name)(*args))
            except Exception as e:  # noqa: BLE001 - as the RPC layer hands it back
                fut.set_exception(e)
            return fut
        return call


class SinkTrainer:
    """A trainer handle's target: records the samples streamed to it."""

    def __init__(self):
        self.samples = []

    def receive(self, samples):
        self.samples += samples
        return True
