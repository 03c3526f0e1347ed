"""Build-on-first-use for the engine's C++ CPU extensions (torch's ``load_inline``, cached on
disk by torch and in memory here), with one clear error when a machine cannot build them.

They are compiled with ``-march=native``, so a build is only good on CPUs with the same
instruction sets. torch's cache (``~/.cache/torch_extensions``, often on a home directory
shared by a cluster's nodes) keys a build by its name, sources and flags, and the flag
``-march=native`` reads the same everywhere: a build made on an AVX-512 node would be loaded
on an AVX2 node and die there of SIGILL. The cache name therefore carries a tag of this CPU's
instruction-set flags (``isa_tag``): each kind of CPU gets, and keeps, its own build."""
from __future__ import annotations

import hashlib
import platform
from functools import cache


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This CPU's feature flags (Linux: the first ``flags``/``Features`` line of
    ``/proc/cpuinfo``), else the machine and processor names."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def isa_tag(flags: str | None = None) -> str:
    """8 hex digits naming this CPU's instruction sets (same flags: same tag)."""
    return hashlib.sha1((cpu_flags() if flags is None else flags).encode()).hexdigest()[:8]


@cache
def build(name: str, source: str, functions: tuple[str, ...], what: str):
    """Compile (or load the cached build of) ``source`` exposing ``functions``, cached under
    ``name`` plus this CPU's ``isa_tag``; ``what`` names the extension in the error raised
    when building fails (no compiler, headers, ...)."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline(name=f"{name}_{isa_tag()}", cpp_sources=source, functions=list(functions),
                           extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:
        raise RuntimeError(f"{what}: building the C++ extension failed ({e}); "
                           "use attention_backend 'torch'") from e
