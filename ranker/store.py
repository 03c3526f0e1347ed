"""Building, saving and loading rankers.

A model folder holds ``meta.json`` (format, kind, config, feature-set fingerprint, target
definition) plus the kind's own files (``lgbm.txt`` + ``lgbm_state.npz`` for LightGBM,
``lm/`` HF-format weights + tokenizer for the small LM). Saves are atomic (temp dir, rename).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

from workers.atomic import replace_dir

FORMAT = "streamrl-length-ranker"
FORMAT_VERSION = 1
TARGET = "mean of resp_words (whitespace words) over a prompt's answers; models regress log(1 + words)"


def _lgbm():
    from ranker.lgbm import LgbmRanker
    return LgbmRanker


def _lm():
    from ranker.lm import LmRanker
    return LmRanker


def _ensemble():
    from ranker.ensemble import EnsembleRanker
    return EnsembleRanker


# kind -> ranker class (imported lazily so the LightGBM path never imports torch).
KINDS: dict[str, Callable[[], type]] = {"lgbm": _lgbm, "lm": _lm, "ensemble": _ensemble}


def _cls(kind: str) -> type:
    if kind not in KINDS:
        raise ValueError(f"unknown ranker kind {kind!r}: expected one of {sorted(KINDS)}")
    return KINDS[kind]()


def build(kind: str = "lgbm", **kw):
    """A fresh, unfitted ranker: ``build("lgbm", rounds=200)``; keyword arguments are the
    kind's config fields (``LgbmConfig``, ``LmConfig``, ``EnsembleConfig``)."""
    return _cls(kind)(**kw)


def save(ranker, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
    ranker.save_files(tmp)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": ranker.kind,
            "target": TARGET, **ranker.meta()}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    replace_dir(tmp, path)
    return path


def load(path: str | Path):
    """Load a saved ranker. Raises ``FileNotFoundError`` / ``ValueError`` naming the folder
    when it is not a ranker, and ``FeatureMismatchError`` when it was trained with another
    feature set than this code computes."""
    path = Path(path)
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{path}: not a ranker folder (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e.msg})") from e
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.get('format_version')!r}, this code reads "
                         f"{FORMAT_VERSION}; retrain with `python -m ranker train`")
    return _cls(meta.get("kind", "")).load_files(path, meta)
