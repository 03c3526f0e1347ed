"""``KernelCall``: one planned Triton launch, run by ``launch`` and compiled offline by
``kernels.compile_check`` (so both see exactly the same arguments)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class KernelCall:
    """``fn[grid](*args, **consts, **options)``."""
    fn: Any
    grid: tuple[int, ...]
    args: tuple
    consts: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> None:
        # Triton launches on the calling thread's current GPU and stream, not its tensors': a
        # thread torch RPC runs an engine's calls on starts on GPU 0, whatever device it serves
        with _on(next(a.device for a in self.args if isinstance(a, torch.Tensor))):
            self.fn[self.grid](*self.args, **self.consts, **self.options)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
