"""The engine's C++ CPU extensions in tests: build (first use on a machine takes about a
minute, then cached) or skip with the reason when this machine cannot build them."""
import pytest


def extension_or_skip(module, what: str):
    """``module.load()`` or ``pytest.skip``; returns the loaded extension."""
    try:
        return module.load()
    except RuntimeError as e:
        pytest.skip(f"{what} unavailable: {e}")
