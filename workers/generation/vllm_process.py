"""Where a vLLM instance's engine core runs: in this process, or in a spawned child that sees
this instance's GPU alone and this process's thread count.

vLLM's one-process executor computes on ``cuda:0`` whatever ``engine.device`` says, and under
torchrun a child would read ``OMP_NUM_THREADS=1`` from the environment: both are set here for
the child while vLLM starts it.
"""
from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch

from workers.env import env_var
from workers.generation.config import EngineConfig
from workers.model import resolve_device


IN_PROCESS = [0]  # vLLM engine cores running in this process now (VLLMEngine, until close)


def use_subprocess(cfg: EngineConfig) -> bool:
    """The engine core in a spawned child: asked (``backend_options.multiprocess``); forced by
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the environment (vLLM makes a child then, whatever
    it is asked: taken as one, so the child's settings are made); in a process with a
    ``torch.distributed`` world (vLLM builds its groups on it, and its shutdown destroys the
    process group); beside another in-process engine core (one's shutdown tears down the model
    parallel groups the other steps in); or on a GPU other than this process's first (vLLM's
    one-process executor computes on cuda:0). ``multiprocess: false`` in the two shared-state
    cases is refused."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "").strip().lower() in ("1", "true"):
        return True
    dist = torch.distributed
    shared = ("torch.distributed is initialized in this process" if dist.is_available() and dist.is_initialized()
              else "another vLLM engine runs in this process" if IN_PROCESS[0] else "")
    opt = cfg.backend_options.get("multiprocess")
    if opt is not None:
        if not opt and shared:
            raise ValueError(f"engine.backend_options.multiprocess: false, but {shared}: vLLM's in-process engine "
                             "core destroys the process group and its parallel groups when it is closed; drop "
                             "multiprocess: false (a child is started)")
        return bool(opt)
    return bool(shared) or (gpu_index(cfg) or 0) > 0


def gpu_index(cfg: EngineConfig) -> int | None:
    """This instance's CUDA device in this process (``engine.device`` ``cuda:N``; "" or "cuda":
    this rank's GPU, ``resolve_device``, not the calling thread's current one), None on CPU."""
    device = resolve_device(cfg.device)
    if device.type != "cuda":
        return None
    return device.index or 0


def child_gpu(index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` a vLLM engine-core child starts with to compute on this
    process's GPU ``index`` alone (named as this process's own list names it). vLLM's workers
    bind to ``cuda:<local rank>``, 0 for one instance: without it every instance of a node
    computed on GPU 0 (not run on a GPU here)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index >= len(visible):
        raise ValueError(f"engine.device cuda:{index}: CUDA_VISIBLE_DEVICES={','.join(visible)} shows "
                         f"{len(visible)} GPU(s)")
    return visible[index] if visible else str(index)


@contextmanager
def child_env(cfg: EngineConfig, subprocess: bool) -> Iterator[None]:
    """The environment to start vLLM's engine in, restored after. In a child: ``OMP_NUM_THREADS``
    = this process's torch thread count (a spawned child reads its pool size from the
    environment only, and vLLM's CPU worker refuses ``torch.set_num_threads``: under torchrun
    it computed on one core) and, on a GPU, ``CUDA_VISIBLE_DEVICES`` naming that GPU alone.
    In this process a GPU other than cuda:0 is refused (vLLM would compute on cuda:0)."""
    gpu = gpu_index(cfg)
    if not subprocess and (gpu or 0) > 0:
        raise ValueError(f"engine.device cuda:{gpu} with engine.backend_options.multiprocess: false: vLLM's "
                         "in-process executor computes on cuda:0; drop multiprocess: false (a child is "
                         "started on that GPU) or set CUDA_VISIBLE_DEVICES")
    with ExitStack() as stack:
        if subprocess:
            stack.enter_context(env_var("OMP_NUM_THREADS", str(torch.get_num_threads())))
            if gpu is not None:
                stack.enter_context(env_var("CUDA_VISIBLE_DEVICES", child_gpu(gpu)))
        yield


def rng_states() -> tuple:
    """This process's torch, numpy and Python generator states (vLLM seeds all three with its own
    seed when an engine core starts in this process, and its first import draws from random)."""
    import random

    import numpy as np

    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def set_rng_states(states: tuple) -> None:
    import random

    import numpy as np

    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def drop_world() -> None:
    """Tear down what an in-process vLLM start that failed set up in this process (its parallel
    groups and one-rank torch.distributed world), as its shutdown would have."""
    try:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # noqa: BLE001 - best effort: the start's own error is what the caller hears
        pass
