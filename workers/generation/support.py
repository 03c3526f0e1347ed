"""Whether this rank can run the configured engine, asked by the controller before any engine
is built (``controller.world.check_engine``): a CPU-only torch under ``engine.device: cuda``,
vLLM missing under ``engine.backend: vllm``, your own engine not loading there, or
``attention_backend: triton`` on a CPU is one config error naming the key, not a traceback
from every instance's constructor."""
from __future__ import annotations

import importlib.util

import torch

from workers.generation.config import EngineConfig


def cuda_devices() -> int:
    """How many CUDA devices this process's torch sees (0: none, or a CPU build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def engine_problem(cfg: EngineConfig, where: str) -> str | None:
    """What keeps this rank from building ``cfg``'s engine, as a config error naming the key
    (``where``: e.g. "rank 1 (generation)"), or None. Nothing is built or loaded, but your own
    engine's module (``engine.backend: module:Name``) is imported."""
    n = cuda_devices()
    if cfg.device.startswith("cuda"):
        index = int(cfg.device.partition(":")[2] or 0)
        if n == 0:
            return (f"engine.device: {cfg.device!r}, but CUDA is not available on {where}; set engine.device: "
                    "cpu, or \"\" to use CUDA when there is a GPU")
        if index >= n:
            return f"engine.device: {cfg.device!r}, but {where} has {n} CUDA device(s)"
    device = torch.device(cfg.device) if cfg.device else torch.device("cuda" if n else "cpu")
    if cfg.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            from workers.generation.vllm_engine import INSTALL_HINT

            return f"engine.backend: 'vllm', but on {where}: {INSTALL_HINT}"
        from workers.generation.vllm_args import context_problem

        return context_problem(cfg)  # vLLM picks its own attention
    if cfg.backend != "native":  # your own engine: it loads here (its device and attention are its own)
        from workers.generation.factory import engine_factory

        try:
            engine_factory(cfg.backend)
        except ValueError as e:
            return f"{e} (on {where})"
        return None
    if cfg.attention_backend == "cpu" and device.type != "cpu":
        return (f"engine.attention_backend: 'cpu' is the CPU kernel, but the engine on {where} runs on "
                f"{device}; use 'auto'")
    if cfg.attention_backend == "triton":
        from workers.generation import kernels_package

        try:
            kernels = kernels_package.load()
        except ImportError as e:  # another package named 'kernels' shadows this project's
            return f"engine.attention_backend: 'triton' on {where}: {e}"
        if not kernels.triton_usable(device):
            return (f"engine.attention_backend: 'triton' cannot run on {where}, whose engine device is {device}: "
                    "it needs triton "
                    "(pip install -e .[kernels]) and CUDA, or TRITON_INTERPRET=1 (slow: tests only); use 'auto', "
                    "or 'cpu' for the CPU kernel")
    return None
