"""Triton kernels for the decode step, each beside a plain torch reference.

Triton is optional (the ``kernels`` extra). This package imports without it, and nothing here
imports triton at module level: the ``@triton.jit`` kernels live in private ``_*_triton.py``
modules that are imported on first use. That matters for tests, which set
``TRITON_INTERPRET=1`` before the first triton kernel is *defined* (triton decides between the
compiler and the interpreter when ``@triton.jit`` runs), whatever order modules are imported in.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

# Hugging Face's hub kernels package has this top-level name too: this marker tells the two apart
# (workers/generation/kernels_package.py)
PROJECT = "streamrl"


def triton_available() -> bool:
    """True when the ``triton`` package is installed (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``; the values
    triton's own knob reads as true)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def triton_usable(device: torch.device | str) -> bool:
    """True when triton kernels can run on tensors of ``device``: compiled on CUDA, or anywhere
    under the interpreter."""
    if not triton_available():
        return False
    return interpreting() or torch.device(device).type == "cuda"


def interpreter_mismatch() -> str | None:
    """Why triton kernels cannot run in the mode the environment asks for, or None.

    Triton fixes interpreter-vs-compiler per function when ``@triton.jit`` runs, including its
    own ``tl.max``/``tl.sum`` at ``import triton``; so ``TRITON_INTERPRET=1`` set after triton
    was imported cannot take effect (calls then fail with "Cannot call @triton.jit'd outside
    of the scope of a kernel")."""
    if not interpreting() or sys.modules.get("triton") is None:
        return None
    import triton.language as tl

    if type(tl.max).__name__ != "InterpretedFunction":
        return ("TRITON_INTERPRET=1 was set after `import triton`; set it before triton is "
                "first imported (importing `kernels` is fine: it imports triton lazily)")
    return None


__all__ = ["triton_available", "interpreting", "triton_usable", "interpreter_mismatch"]
