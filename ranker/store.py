"""Building, saving and loading rankers.

A model folder holds ``meta.json`` (format, kind, config, feature-set fingerprint, target
definition) plus the kind's own files (``lgbm.txt`` + ``lgbm_state.npz`` for LightGBM,
``lm/`` HF-format weights + tokenizer for the small LM). Saves are atomic (temp dir, rename);
meta.json records a sha256 of every other file (``files``), checked at load before anything is
parsed; a save replaces only a folder holding nothing else.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Callable

from workers.atomic import atomic_dir, file_digest, folder_digests, remove_stale_temps

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
# what a ranker of your own defines beside what ``ranker.base.LogLengthRanker`` (its base)
# gives (``predict``, ``save``, the ``_need_*`` checks); ``load_files`` is a classmethod
RANKER_MEMBERS = ("fit", "update", "predict_log", "fitted", "min_rows", "save_files", "load_files", "meta")


def is_kind(kind) -> bool:
    """A built-in kind, or the form of your own (``module:Name`` / ``file.py:Name``)."""
    from workers.tasks.plugins import is_plugin

    return isinstance(kind, str) and (kind in KINDS or is_plugin(kind))


def _cls(kind: str) -> type:
    if kind in KINDS:
        return KINDS[kind]()
    from workers.tasks.plugins import load_plugin

    if not is_kind(kind):
        raise ValueError(f"unknown ranker kind {kind!r}: expected one of {sorted(KINDS)}, or module:Name / "
                         "file.py:Name of your own")
    from ranker.base import LogLengthRanker

    cls = load_plugin(kind, "ranker.kind")
    if not (isinstance(cls, type) and issubclass(cls, LogLengthRanker)):
        raise ValueError(f"ranker.kind: {kind!r} is not a subclass of ranker.base.LogLengthRanker "
                         "(docs/ranker.md, 'Your own ranker')")
    missing = [m for m in RANKER_MEMBERS if getattr(cls, m, None) is getattr(LogLengthRanker, m, None)]
    if missing:
        raise ValueError(f"ranker.kind: {kind!r} does not define {', '.join(missing)}: a ranker of your own "
                         f"defines {', '.join(RANKER_MEMBERS)} (docs/ranker.md, 'Your own ranker')")
    return cls


def canonical_kind(kind: str) -> str:
    """``kind`` as a saved folder records it and the run compares it: your own ``file.py:Name``
    with the file's absolute path (the same class from any working directory)."""
    from workers.tasks.plugins import is_plugin

    if kind in KINDS or not is_plugin(kind):
        return kind
    module, _, attr = kind.rpartition(":")
    return f"{Path(module).expanduser().resolve()}:{attr}" if module.endswith(".py") else kind


def _named(model, kind: str):
    """``model`` with ``kind`` set to the name it was built or loaded by (your own class's
    ``module:Name``: what its saved folder's meta.json records, and the run compares)."""
    if kind not in KINDS:
        try:
            model.kind = canonical_kind(kind)
        except AttributeError as e:  # a read-only property of the user's class
            raise ValueError(f"ranker.kind: {kind!r}: its 'kind' cannot be set ({e}); the store sets it to the "
                             "name the ranker was built by: leave kind out of your class") from None
    return model


def build(kind: str = "lgbm", **kw):
    """A fresh, unfitted ranker: ``build("lgbm", rounds=200)``; keyword arguments are the
    kind's config fields (``LgbmConfig``, ``LmConfig``, ``EnsembleConfig``; your own class's
    constructor arguments). An LM's ``model_dir`` that is no model folder is refused here, before
    anything is generated for its fit (``LmConfig.check_model_dir``)."""
    r = _named(_cls(kind)(**kw), kind)
    for c in (getattr(r, "cfg", None), getattr(getattr(r, "cfg", None), "lm", None)):
        if callable(getattr(c, "check_model_dir", None)):
            c.check_model_dir()
    return r


def save(ranker, path: str | Path) -> Path:
    """Save atomically to folder ``path`` (a symbolic link: into the folder it points to) and
    return the folder. Refuses (ValueError) a ``path`` that exists and is not a ranker folder, or
    holds anything its ranker did not save (only a ranker is replaced); an I/O error (a full disk,
    no permission) raises OSError naming ``path``. No temp folder is left behind, also after
    Ctrl-C; ones left by a killed save (``.NAME.tmpXXXXXXXX``) are removed by the next save."""
    path = Path(path).resolve()  # "." and ".." get a real name and parent; a link is followed
    ranker._need_fitted()
    check_target(path)
    # temp folders of saves killed before they could clean up (one save at a time per folder:
    # a running one's would go too); tempfile.mkdtemp's random suffix is 8 of [a-z0-9_]
    remove_stale_temps(path.parent, re.escape(f".{path.name}.tmp") + "[a-z0-9_]{8}")
    try:
        with atomic_dir(path) as tmp:  # removed when anything in it fails, also Ctrl-C
            ranker.save_files(tmp)
            meta = {**ranker.meta(), "format": FORMAT, "format_version": FORMAT_VERSION, "kind": ranker.kind,
                    "target": TARGET, "files": folder_digests(tmp, "sha256")}  # the store's keys win
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    except Exception as e:  # OSError, or a writer's own I/O error (safetensors raises SafetensorError)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise OSError(getattr(e, "errno", None), f"cannot save the ranker ({why})", str(path)) from e
    return path


def check_target(path: Path) -> None:
    """Refuse, before any work, a save target that is neither an empty folder nor a ranker folder
    holding only what its ranker saved (a save replaces the whole folder, so it never wipes
    other files), or that cannot be created or written."""
    real = Path(path).resolve()
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise ValueError(f"{path}: is the current folder or holds it; a save replaces the whole folder, which "
                         f"would leave this shell in a deleted one: run from outside it (cd ..)")
    if real.exists():
        if not real.is_dir():
            raise ValueError(f"{path}: exists and is not a folder; refusing to replace it with a ranker")
        if any(real.iterdir()):
            _check_only_ranker_files(path, real)
    check_writable_parent(path)


def check_writable_parent(path: Path) -> None:
    """Refuse ``path`` (a file or folder to be created, through a temp entry beside it) when its
    nearest existing parent is not a folder or cannot be written: found by creating and removing
    a temp folder there, which also catches read-only and special file systems (/proc)."""
    real = Path(path).resolve()
    parent = next(p for p in real.parents if p.exists())
    if not parent.is_dir():
        raise ValueError(f"{path}: cannot create it, {parent} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{real.name}.tmp", dir=parent))
    except OSError as e:
        raise ValueError(f"{path}: cannot write in {parent} ({e.strerror or e})") from e


def _check_only_ranker_files(path: Path, real: Path) -> None:
    try:
        meta = json.loads((real / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: exists and is not a ranker folder (no ranker meta.json); refusing to "
                         f"replace what is in it: save to a new folder")
    if not isinstance(meta.get("files"), dict):
        raise ValueError(f"{path}: ranker folder saved without a file list (by an older version), so its files "
                         f"cannot be told from others; refusing to replace it: delete it or save to a new folder")
    extra = _foreign_entries(real, {"meta.json", *meta["files"]})
    if extra:
        shown = ", ".join(extra[:5]) + (f", ... ({len(extra)} in all)" if len(extra) > 5 else "")
        raise ValueError(f"{path}: holds things its saved ranker does not list ({shown}); a save replaces the "
                         f"whole folder, so it refuses: move them out, or save to a new folder")


def _foreign_entries(folder: Path, keep: set[str]) -> list[str]:
    """Files and folders under ``folder`` that are not in ``keep`` (relative paths of files) nor a
    folder on the way to one; a foreign folder is listed once (``name/``), not its contents."""
    dirs = {p.as_posix() for k in keep for p in Path(k).parents}
    out = []
    for d, subdirs, names in os.walk(folder):
        rel = Path(d).relative_to(folder)
        out += [(rel / n).as_posix() for n in names if (rel / n).as_posix() not in keep]
        foreign = [n for n in subdirs if (rel / n).as_posix() not in dirs]
        out += [(rel / n).as_posix() + "/" for n in foreign]
        subdirs[:] = [n for n in subdirs if n not in foreign]
    return sorted(out)


# files whose parser takes the whole process down on damage (LightGBM's model texts: the model,
# and the base an online update boosts from): one present in the folder must be on the list
_CHECK_FIRST = ("lgbm.txt", "lgbm_base.txt")


def _verify(folder: Path, files) -> None:
    """Check every file ``save`` recorded before anything parses it (LightGBM aborts the whole
    process, even with a segfault, on some truncated model files instead of raising): a folder
    without the list (saved by an older version) is refused too, since its files cannot be checked."""
    if files is None:
        raise ValueError(f"{folder}/meta.json: no 'files' checksum list (saved by an older version), so its "
                         f"files cannot be checked before parsing; retrain with `python -m ranker train`")
    if not isinstance(files, dict):
        raise ValueError(f"{folder}/meta.json: 'files' must be an object of checksums")
    for rel in _CHECK_FIRST:  # a list that leaves one out (hand-edited, half copied) skipped the check
        if (folder / rel).exists() and rel not in files:
            raise ValueError(f"{folder}/meta.json: 'files' does not list {rel}, so it cannot be checked before "
                             f"LightGBM parses it; retrain or restore the folder")
    for rel, want in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"{folder}/meta.json: bad file name {rel!r} in 'files'")
        p = folder / rel
        if not p.is_file():
            raise ValueError(f"{p}: missing; retrain or restore it")
        if file_digest(p, "sha256") != want:
            raise ValueError(f"{p}: checksum mismatch (truncated or modified); retrain or restore it")


def _read_meta(path: Path) -> dict:
    meta_path = path / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: does not exist")
    if not path.is_dir():
        raise ValueError(f"{path}: is not a folder (a ranker is a folder holding meta.json)")
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
    if not is_kind(meta.get("kind")):
        raise ValueError(f"{meta_path}: unknown ranker kind {meta.get('kind')!r}: expected one of {sorted(KINDS)}, "
                         "or module:Name / file.py:Name of your own")
    return meta


def load(path: str | Path):
    """Load a saved ranker. Raises ``FileNotFoundError`` / ``ValueError`` naming the folder
    when it is not a ranker (or a file in it is damaged), and ``FeatureMismatchError`` when it
    was trained with another feature set than this code computes."""
    from ranker.features import FeatureMismatchError

    path = Path(path)
    meta = _read_meta(path)
    _verify(path, meta.get("files"))
    try:
        cls = _cls(meta["kind"])  # your own class, imported by the name the folder records
    except ValueError as e:
        raise ValueError(f"{path}/meta.json: ranker kind {meta['kind']!r} does not load: {e}") from None
    from ranker.base import LogLengthRanker

    try:
        loaded = cls.load_files(path, meta)
        if isinstance(loaded, LogLengthRanker):
            return _named(loaded, meta["kind"])
    except FeatureMismatchError:
        raise
    except Exception as e:  # any parse failure of a damaged/hand-edited folder: name the folder
        raise ValueError(f"{path}: not a valid {meta.get('kind')} ranker folder ({type(e).__name__}: {e}); "
                         f"retrain or restore it") from e
    # your own class's load_files forgot its return
    raise ValueError(f"{path}: ranker kind {meta['kind']!r}: load_files returned {type(loaded).__name__}, "
                     "not a ranker (it must return the ranker it loaded)")
