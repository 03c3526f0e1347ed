"""The engine's C++ CPU extensions in tests: build (first use on a machine takes about a
minute, then cached), or skip when this machine has no toolchain to build them. A build that
fails on a machine with the toolchain is a failure (a defect in the project's C++ source), not
a skip."""
import os
import shutil

import pytest


def missing_toolchain() -> str | None:
    """What torch's ``load_inline`` needs and this machine lacks (a C++ compiler, ninja), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH)"
    try:
        from torch.utils.cpp_extension import verify_ninja_availability
        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed"
    return None


def extension_or_skip(module, what: str):
    """``module.load()``; skips only when the toolchain is absent, fails when the build fails."""
    lacking = missing_toolchain()
    if lacking is not None:
        pytest.skip(f"{what} unavailable: {lacking}")
    return module.load()
