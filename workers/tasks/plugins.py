"""User code named in a config: ``"package.module:attr"`` or ``"path/to/file.py:attr"``.

How a user brings their own task (``task.name``) or reward function (the file tasks'
``verifier``) without editing this project. A dotted module is imported with the current
directory on ``sys.path`` (torchrun puts only the script's folder there); a ``.py`` path is
loaded as a file, relative to the current directory. Every failure is one ``ValueError``
naming the config key and the spec.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Mapping


def is_plugin(spec: str) -> bool:
    """Whether ``spec`` names user code (``module:attr``) rather than a registered name."""
    module, sep, attr = spec.rpartition(":")
    return bool(sep and attr) and (module.endswith(".py") or module.replace(".", "_").isidentifier())


def builtin_or_plugin(spec: str, builtins: Mapping[str, Any], key: str, otherwise: str) -> Any:
    """``builtins[spec]``, or the user code ``spec`` names (``load_plugin``); anything else is one
    ValueError, ``{key}: {spec!r} is not one of [the built-in names]{otherwise}``."""
    if spec in builtins:
        return builtins[spec]
    if not is_plugin(spec):
        raise ValueError(f"{key}: {spec!r} is not one of {sorted(builtins)}{otherwise}")
    return load_plugin(spec, key)


def load_plugin(spec: str, key: str) -> Any:
    """The object ``spec`` names; ``key`` (e.g. ``task.name``) is named in every error."""
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        module = _load_file(Path(module_name), spec, key)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # the user's module before an installed one of that name
        try:
            module = importlib.import_module(module_name)
        except (Exception, SystemExit) as e:  # ImportError, or the module's own code failing (a
            # script's argparse or sys.exit at import ended the process naming no plugin)
            raise ValueError(f"{key}: cannot import {module_name!r} for {spec!r} ({type(e).__name__}: {e})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}: {spec!r} is a {type(obj).__name__}, not a class or function")
    return obj


def _load_file(path: Path, spec: str, key: str):
    if not path.is_file():
        raise ValueError(f"{key}: {path} (from {spec!r}) is not a file (relative paths are from {os.getcwd()})")
    name = "streamrl_plugin_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before running it, as import does (dataclasses look it up)
    try:
        loader_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # SystemExit: a script's argparse / sys.exit at import
        sys.modules.pop(name, None)
        raise ValueError(f"{key}: loading {path} for {spec!r} failed ({type(e).__name__}: {e})") from None
    return module
