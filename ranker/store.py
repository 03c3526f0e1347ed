"""Building, saving and loading rankers.

A model folder holds ``meta.json`` (format, kind, config, feature-set fingerprint, target
definition) plus the kind's own files (``lgbm.txt`` + ``lgbm_state.npz`` for LightGBM,
``lm/`` HF-format weights + tokenizer for the small LM). Saves are atomic (temp dir, rename);
meta.json records a sha256 of every other file, checked at load before anything is parsed.
"""
from __future__ import annotations

import hashlib
import json
import shutil
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
    """Save atomically to folder ``path``. Refuses (ValueError) a ``path`` that exists and is not a
    ranker folder (a file, or a folder with other things in it): only a ranker is replaced."""
    path = Path(path)
    ranker._need_fitted()
    check_target(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
    except OSError as e:
        raise ValueError(f"{path}: cannot create the model folder ({e.strerror or e})") from e
    try:
        ranker.save_files(tmp)
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": ranker.kind,
                "target": TARGET, **ranker.meta(), "files": _checksums(tmp)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, path)
    return path


def check_target(path: Path) -> None:
    """Refuse a save target that is not a ranker folder (and not an empty folder), or whose
    parent cannot be a folder, so a save never wipes other files."""
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path}: exists and is not a folder; refusing to replace it with a ranker")
        if any(path.iterdir()) and not _is_ranker_folder(path):
            raise ValueError(f"{path}: exists and is not a ranker folder (no ranker meta.json); refusing to "
                             f"replace what is in it: save to a new folder")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{path}: cannot create it, {parent} is not a folder")
            break


def _is_ranker_folder(path: Path) -> bool:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _checksums(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under ``folder``."""
    return {p.relative_to(folder).as_posix(): _sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _verify(folder: Path, files) -> None:
    """Check every file ``save`` recorded before anything parses it (LightGBM aborts the whole
    process on some truncated model files instead of raising)."""
    if not isinstance(files, dict):
        raise ValueError(f"{folder}/meta.json: 'files' must be an object of checksums")
    for rel, want in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"{folder}/meta.json: bad file name {rel!r} in 'files'")
        p = folder / rel
        if not p.is_file():
            raise ValueError(f"{p}: missing; retrain or restore it")
        if _sha256(p) != want:
            raise ValueError(f"{p}: checksum mismatch (truncated or modified); retrain or restore it")


def _read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{path}: not a ranker folder (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e.msg})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: cannot read ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format_version {meta.get('format_version')!r}, this code reads "
                         f"{FORMAT_VERSION}; retrain with `python -m ranker train`")
    return meta


def load(path: str | Path):
    """Load a saved ranker. Raises ``FileNotFoundError`` / ``ValueError`` naming the folder
    when it is not a ranker (or a file in it is damaged), and ``FeatureMismatchError`` when it
    was trained with another feature set than this code computes."""
    from ranker.features import FeatureMismatchError

    path = Path(path)
    meta = _read_meta(path)
    # Folders saved before checksums were recorded (no "files") still load, unverified.
    if "files" in meta:
        _verify(path, meta["files"])
    cls = _cls(meta.get("kind", ""))
    try:
        return cls.load_files(path, meta)
    except FeatureMismatchError:
        raise
    except Exception as e:  # any parse failure of a damaged/hand-edited folder: name the folder
        raise ValueError(f"{path}: not a valid {meta.get('kind')} ranker folder ({type(e).__name__}: {e}); "
                         f"retrain or restore it") from e
