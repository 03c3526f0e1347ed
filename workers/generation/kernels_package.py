"""This project's ``kernels`` package (Triton decode kernels), checked to be this project's.

Hugging Face's ``kernels`` (hub kernels; transformers >= 5.25 requires it) installs a top-level
package of the same name. Where both are installed, ``import kernels`` finds whichever comes
first on the path; with Hugging Face's, the engine's CUDA path would fail on a missing
attribute far from the cause. ``load()`` says what happened instead. Only the CUDA/Triton
paths import it: the CPU engine runs without it.
"""
from __future__ import annotations

from types import ModuleType


def load() -> ModuleType:
    """``kernels``, this project's; ImportError naming the module found when it is another."""
    import kernels

    if getattr(kernels, "PROJECT", None) != "streamrl":
        found = getattr(kernels, "__file__", None) or repr(kernels)
        raise ImportError(
            f"'import kernels' found {found}, not StreamRL's "
            "kernels package: another package named 'kernels' (Hugging Face's hub kernels, which "
            "transformers >= 5.25 requires) is installed here and shadows it. Install StreamRL in "
            "an environment without it (see docs/architecture.md), or use attention_backend 'torch'")
    return kernels
