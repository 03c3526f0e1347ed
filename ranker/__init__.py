"""Output-length ranker: predicts from the prompt text alone how long the policy's answer
will be, so the SGS can find long-tail prompts before generation (paper section 5.2).

    import ranker
    r = ranker.build("lgbm")            # or "lm", "ensemble"
    r.fit(prompts, lengths)             # lengths: mean answer length in words
    r.predict(prompts) -> list[float]   # estimated words (only the order is reliable)
    r.update(prompts, lengths)          # cheap online step between iterations
    r.save(dir); r = ranker.load(dir)
    r = ranker.bootstrap(generate, prompts, n=256)   # no trace yet: measure the policy

CLI: ``python -m ranker train|predict|eval`` (see docs/ranker.md).
"""
import os

# OpenMP (LightGBM, torch) threads spin-wait by default; on a shared 2-core machine that made
# LightGBM with 2 threads ~12x slower than with 1. Passive waiting costs little when cores are
# free. Set before anything loads libgomp; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ranker.bootstrap import bootstrap  # noqa: E402
from ranker.data import TraceError, read_traces  # noqa: E402
from ranker.store import KINDS, build, load, save  # noqa: E402

__all__ = ["build", "load", "save", "bootstrap", "KINDS", "read_traces", "TraceError",
           "FeatureMismatchError", "ranking_report", "recall_at"]
# these load on first use (PEP 562): ``ranker.store``'s registry is read by every rank's config
# check, which should not pay for sklearn and scipy.stats (~1.5 s a process)
_LAZY = {"FeatureMismatchError": "ranker.features", "ranking_report": "ranker.metrics", "recall_at": "ranker.metrics"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ranker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
