"""Build-on-first-use for the engine's C++ CPU extensions (torch's ``load_inline``, cached on
disk by torch and in memory here), with one clear error when a machine cannot build them.

They are compiled with ``-march=native``, so a build is only good on CPUs with the same
instruction sets. torch's cache (``~/.cache/torch_extensions``, often on a home directory
shared by a cluster's nodes) keeps one build per name (a changed source rebuilds it, but a
process that waits on another's build of the same name loads that build, whatever its own
source), and the flag ``-march=native`` reads the same everywhere: a build made on an AVX-512
node would be loaded on an AVX2 node and die there of SIGILL. The cache name therefore carries
a tag of this CPU's instruction-set flags (``isa_tag``) and a digest of the source and flags:
each kind of CPU and each version of the code gets, and keeps, its own build (two checkouts run
at once never load each other's).

The C++ sources are in ``csrc/`` (``csrc`` reads them): ``vexp.h``, prepended to each
extension's source, is the one ``exp`` they share (plain C++ the compiler vectorises under
``-O3 -march=native``, where ``std::exp`` is a libm call per element)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import platform
from functools import cache
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")


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
    ``name`` plus this CPU's ``isa_tag`` and a digest of the source and flags; ``what`` names
    the extension in the error raised when building fails (no compiler, headers, ...). Each
    function is bound with ``torch::wrap_pybind_function_no_gil``: like torch's own ops, it runs
    without the GIL, so the generation worker's other threads (the outbox streaming samples, the
    weight-sync lanes receiving the next version) run while a step's kernels do;
    ``load_inline(functions=...)`` binds them holding it."""
    from torch.utils.cpp_extension import load_inline

    cflags, ldflags = ["-O3", "-march=native", "-ffast-math", "-fopenmp"], ["-fopenmp"]
    sources = source + bindings(functions)
    digest = hashlib.sha1("\0".join([sources, *cflags, *ldflags]).encode()).hexdigest()[:8]
    full = f"{name}_{isa_tag()}_{digest}"
    try:
        with _build_lock(full) as build_dir:
            return load_inline(name=full, cpp_sources=sources, extra_cflags=cflags, extra_ldflags=ldflags,
                               build_directory=build_dir, verbose=False)
    except Exception as e:
        raise RuntimeError(f"{what}: building the C++ extension failed ({e}); "
                           "use attention_backend 'torch'") from e


@contextlib.contextmanager
def _build_lock(name: str):
    """The build folder of extension ``name``, held under an ``flock`` for the build. torch's
    own lock (a ``lock`` file made with O_EXCL, removed in a ``finally``) outlives a builder
    killed mid-build (SIGKILL, the OOM killer, ``os._exit`` of another thread), and every later
    start then waited on it for ever, silently. The kernel drops an flock with its process, so
    whoever holds this one knows no live builder holds torch's: a leftover is removed."""
    from torch.utils.cpp_extension import _get_build_directory  # torch's folder for ``name``

    build_dir = Path(_get_build_directory(name, False))
    with open(build_dir.parent / f"{name}.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield str(build_dir)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def bindings(functions: tuple[str, ...]) -> str:
    """The module definition binding ``functions``: torch's error translation, GIL released
    while each runs (its arguments are converted and its result wrapped with the GIL held)."""
    defs = "".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");\n' for f in functions)
    return f"\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n"


def csrc(*names: str) -> str:
    """The C++ source made of the files ``names`` of ``csrc/``, in that order (each after a
    newline)."""
    return "".join("\n" + (CSRC / name).read_text() for name in names)
