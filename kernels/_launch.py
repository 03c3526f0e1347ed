"""``KernelCall``: one planned Triton launch, run by ``launch`` and compiled offline by
``kernels.compile_check`` (so both see exactly the same arguments)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KernelCall:
    """``fn[grid](*args, **consts, **options)``."""
    fn: Any
    grid: tuple[int, ...]
    args: tuple
    consts: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.consts, **self.options)
