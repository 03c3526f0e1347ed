"""``--set`` overrides of a run config: parsing (``parse_override``: the value read as YAML,
with advice that follows the key's type when it is not valid YAML), applying them to the YAML
mapping, and naming the ``--set`` a config error comes from, exactly as typed."""
from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from typing import Any

import yaml

from controller.config import OWNED_SECTIONS, Config, ConfigError, from_dict
from controller.config_types import key_hint
from controller.config_yaml import dump, load_checked
from workers.config_schema import key_fields


def parse_overrides(overrides: dict | typing.Sequence[str] | None) -> tuple[dict, dict]:
    """(dotted key -> value, dotted key -> the ``--set`` text to echo). A text is echoed as it
    was typed; a value given as a mapping is echoed as YAML (``null``, ``.nan``, ``true``)."""
    if not overrides:
        return {}, {}
    if isinstance(overrides, dict):
        return dict(overrides), {k: f"--set {k}={_yaml_text(v)}" for k, v in overrides.items()}
    if isinstance(overrides, str):
        overrides = [overrides]
    values, typed = {}, {}
    for text in overrides:
        k, v = parse_override(text)
        values.pop(k, None)  # the last --set of a key wins, in its own place
        values[k], typed[k] = v, f"--set {text}"
    return values, typed


def _yaml_text(value: Any) -> str:
    """``value`` as one line of YAML, as it would be typed after ``--set key=``."""
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    try:
        text = dump(plain(value), default_flow_style=True, width=math.inf).strip()
    except yaml.YAMLError:
        return str(value)
    return text.removesuffix("\n...").removesuffix("...").strip()


def overridden(d: dict, overrides: dict) -> dict:
    d = copy.deepcopy(d)
    for dotted, value in overrides.items():
        apply_override(d, dotted, value)
    return d


def blame(d: dict, overrides: dict, typed: dict, world_size: int | None, error: str) -> str:
    """The ``--set`` overrides the config error ``error`` comes from (as typed): the one whose
    key it names, else (a rule over several keys) those without which the config loads, else
    (several bad ones) those whose key the error mentions; '' when the file's own values do (one
    whose removal only changed the error to another of the file's was blamed for the file's:
    review, s53)."""
    named = _naming(error, overrides, typed)
    if named:
        key = next(k for k in overrides if typed[k] == named[0])
        return typed[_last_setter(key, overrides)]
    blamed = []
    for k in overrides:
        try:
            from_dict(overridden(d, {o: w for o, w in overrides.items() if o != k}), world_size)
        except ConfigError:
            continue
        blamed.append(typed[k])
    if not blamed:  # each alone is not what fails: the error's rule names the one among them it is,
        blamed = [typed[k] for k in overrides if _mentions(error, k)]
    if not blamed:  # else by a section above it ("weight_sync: colocated, ...": review, s56)
        blamed = [typed[k] for k in overrides if any(_mentions(error, s, whole=True) for s in _sections(k))]
    return " ".join(blamed)


def _mentions(error: str, key: str, whole: bool = False) -> bool:
    """``error`` names ``key``, or a key under it; ``whole``: ``key`` itself only (a section:
    ``train`` in "train: ..." but not in "train.iterations ...", a key of the file's)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w{'.' if whole else ''}])", error) is not None


def _sections(key: str) -> list[str]:
    """The dotted sections above ``key`` (``a.b.c``: ``a.b``, ``a``)."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _last_setter(key: str, overrides: dict) -> str:
    """The override whose value ``key`` holds: ``key``'s own, or a whole section above it applied
    later that sets it (``--set train.iterations=5 --set 'train={iterations: -1}'``: the second;
    the first was blamed for its -1: review, s55)."""
    winner = key
    for o, v in overrides.items():  # in the order they are applied
        if o == key:
            winner = o
        elif key.startswith(f"{o}."):
            node = v
            for part in key[len(o) + 1:].split("."):
                node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
            if node is not _ABSENT:
                winner = o
    return winner


_ABSENT = object()


def set_behind(texts: typing.Sequence[str] | None, error: str) -> str:
    """For a config error found after load (the controller's checks with the processes up: the
    task's data, the model folder, the engine on its rank): the ``--set`` behind the key it
    names, as typed (its own key or a section above it), or ''."""
    try:
        overrides, typed = parse_overrides(list(texts or ()))
    except ConfigError:
        return ""
    named = _naming(error, overrides, typed, sections=True)
    return named[-1] if named else ""


def _naming(error: str, overrides: dict, typed: dict, sections: bool = False) -> list[str]:
    """The ``--set`` texts whose key ``error`` starts by naming (``sections``, an error found
    with the processes up: also a section above the key it names, ``task.kwargs`` for
    ``task.kwargs.files: ...``; a key below it, ``task.kwargs.files.test`` for that error; a
    key its advice says to set, ``set task.kwargs.prompt_key``)."""
    lead = error.split(":", 1)[0]

    def names(k: str) -> bool:
        if error.startswith((f"{k}:", f"{k} ", f"{k}[")):
            return True
        return sections and (error.startswith(f"{k}.") or k.startswith(f"{lead}.")
                             or re.search(rf"\bset {re.escape(k)}\b", error) is not None)

    return [typed[k] for k in overrides if names(k)]


def apply_override(d: dict, dotted: str, value: Any) -> None:
    """Set ``d["a"]["b"] = value`` for ``dotted == "a.b"`` (creating the section). A whole
    section given a mapping (``--set 'train={iterations: 5}'``) takes its keys over the file's,
    as OmegaConf merges; it replaced the section, whose other keys went back to their defaults
    (review, s53). Below a section a mapping is a value (``task.kwargs``: replaced)."""
    *parents, leaf = dotted.split(".")
    if not parents and value is None:  # it built the section's defaults over the file's (review, s51)
        raise ConfigError(f"{dotted}: is empty (YAML null); a --set of a whole section would replace the file's "
                          f"{dotted} section with the defaults: set its keys ({dotted}.KEY=VALUE)")
    if not parents and isinstance(value, dict) and isinstance(d.get(leaf), dict):
        for key, v in value.items():
            apply_override(d, f"{leaf}.{key}", v)
        return
    node = d
    for p in parents:
        if node.get(p) is None:
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.iterations=3"`` -> ("train.iterations", 3) (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    k, v = text.split("=", 1)
    k = k.strip()
    try:
        value = load_checked(v, k, f"--set {text}")  # 010 read as octal 8, 1:30 as 90: refused
    except yaml.YAMLError as e:
        why = getattr(e, "problem", None) or str(e).splitlines()[0]
        mark = getattr(e, "problem_mark", None)
        at = f" at character {mark.column + 1}" if mark is not None and mark.line == 0 else ""
        try:
            advice = _unparsed_advice(k)
        except ConfigError as unknown:  # no such key: that is the error, not the value
            raise ConfigError(f"--set {text}: {unknown}") from None
        raise ConfigError(f"--set {text}: the value is not valid YAML ({why}{at}); {advice}") from None
    except ConfigError:
        raise
    except (ValueError, RecursionError) as e:  # a number past Python's digit limit, nesting past its depth
        raise ConfigError(f"--set {text[:80]}: the value cannot be read ({type(e).__name__}: {str(e)[:120]})") from None
    if v.count("#") > _hashes(value):  # YAML took " #..." for a comment and dropped it
        raise ConfigError(f"--set {text}: YAML reads ' #' and what follows as a comment, so the value would be "
                          f"{_yaml_text(value)}; quote it to keep the '#': --set '{k}=\"{v.strip()}\"'")
    return k, value


def _hashes(value: Any) -> int:
    """The '#' characters in the strings (keys too) of a parsed value."""
    if isinstance(value, str):
        return value.count("#")
    if isinstance(value, (list, tuple)):
        return sum(map(_hashes, value))
    if isinstance(value, dict):
        return sum(_hashes(k) + _hashes(x) for k, x in value.items())
    return 0


# ---- what type a dotted key takes (for the advice on a --set value that is not YAML) -----------
# a key inside a free mapping (task.kwargs.*, dispatch.options.*), or of a section its owner
# reads itself (weight_sync, topology): any value
_FREE = object()


def key_type(dotted: str) -> Any:
    """The type hint of a dotted config key (``train.iterations`` -> int; a section -> dict);
    ``_FREE`` inside a free mapping or for a bare name that is no section; raises the usual
    ConfigError for an unknown section or key."""
    import importlib

    section, *rest = dotted.split(".")
    sections = key_fields(Config)
    if section not in sections:
        if not rest:
            return _FREE
        raise ConfigError(f"{section}: unknown section{key_hint(section, sections)} (known: {sorted(sections)})")
    if not rest:
        return dict
    cls = typing.get_type_hints(Config)[section]
    if section in OWNED_SECTIONS:
        cls = getattr(importlib.import_module(OWNED_SECTIONS[section][0]), OWNED_SECTIONS[section][1])
    elif not dataclasses.is_dataclass(cls):
        return _FREE
    hints = typing.get_type_hints(cls)
    key = rest[0]
    if key not in hints:
        raise ConfigError(f"{section}.{key}: unknown key{key_hint(key, hints, section)} (known: {sorted(hints)})")
    if len(rest) > 1:
        return _FREE
    return hints[key]


def _type_words(hint: Any) -> str:
    """``int`` -> 'an int (e.g. 3)': what a key of this type is written as."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [_type_words(a).split(" (e.g.")[0] for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or null" if type(None) in args else "")
    base = origin or hint
    if base is tuple and args:
        item = {int: "ints", float: "numbers", str: "strings"}.get(args[0], "values")
        if args[-1] is Ellipsis:
            return f"a list of {item} (e.g. [1, 2])" if args[0] is int else f"a list of {item}"
        example = {float: "[0.9, 0.999]", int: "[1, 2]"}.get(args[0], "")
        return f"a list of {len(args)} {item}" + (f" (e.g. {example})" if example and len(args) == 2 else "")
    return {int: "an int (e.g. 3)", float: "a number (e.g. 0.5)", bool: "true or false", str: "a string",
            list: "a list (e.g. [1, 2])", tuple: "a list (e.g. [1, 2])",
            dict: "a mapping (e.g. {key: value})"}.get(base, getattr(base, "__name__", str(base)))


def _unparsed_advice(key: str) -> str:
    """What to do about a ``--set key=...`` value that is not valid YAML: quote it when the key
    takes a string; else say what the key takes."""
    hint = key_type(key)
    quote = f"quote it as a YAML string: --set \"{key}='...'\" (a ' inside written as ''), or set it in the YAML file"
    if hint is _FREE or hint is Any:
        return f"if it is a string, {quote}"
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if str in args:
        return quote
    return f"{key} takes {_type_words(hint)}"
