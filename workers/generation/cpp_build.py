"""Build-on-first-use for the engine's C++ CPU extensions (torch's ``load_inline``, cached on
disk by torch and in memory here), with one clear error when a machine cannot build them."""
from __future__ import annotations

from functools import cache


@cache
def build(name: str, source: str, functions: tuple[str, ...], what: str):
    """Compile (or load the cached build of) ``source`` exposing ``functions``; ``what`` names
    the extension in the error raised when building fails (no compiler, headers, ...)."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline(name=name, cpp_sources=source, functions=list(functions),
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:
        raise RuntimeError(f"{what}: building the C++ extension failed ({e}); "
                           "use attention_backend 'torch'") from e
