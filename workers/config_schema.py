"""Mapping -> typed config dataclass, the one way: ``build_section`` checks every key of a
mapping against its dataclass field (known name, type, and the ``Range`` declared next to the
field with ``ranged``) and raises ``ConfigError`` naming the key with the caller's prefix
(``train.iterations``, ``trainer.betas[1]``). The run config (``controller.config``) builds its
sections with it. Here, under ``workers``, so ``controller`` and ``ranker`` both import it.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

RANGE = "range"  # the dataclass field metadata key of a Range
DERIVED = "derived"  # the field metadata key of a field filled by the loader, not a config key


class ConfigError(ValueError):
    """A config value is wrong; the message names the key."""


def expand_path(value: str) -> str:
    """A path as a shell would read it: a leading ``~`` the user's home, ``$VAR`` / ``${VAR}`` a
    set environment variable (an unset one left as written). A YAML value is no shell word, so
    nothing else expands them (``~/runs`` made a folder named ``~``; verl's scripts write
    ``$HOME/data/...``)."""
    return os.path.expanduser(os.path.expandvars(value))


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: ``lo <= v <= hi`` (``<`` at an ``open`` end; None:
    unbounded). ``note`` says what special values mean (``0: never``)."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    note: str = ""

    def __contains__(self, v) -> bool:
        return ((self.lo is None or (v > self.lo if self.open_lo else v >= self.lo))
                and (self.hi is None or (v < self.hi if self.open_hi else v <= self.hi)))

    def __str__(self) -> str:
        if self.hi is None:
            text = f"{'>' if self.open_lo else '>='} {self.lo}"
        else:
            text = f"in {'(' if self.open_lo else '['}{self.lo}, {self.hi}{')' if self.open_hi else ']'}"
        return f"{text} ({self.note})" if self.note else text


SEEDS = Range(0, 2**32, open_hi=True)  # numpy's seed range; sampling seeds are train.seed * 7919 + index


def ranged(default: Any, rng: Range) -> Any:
    """A dataclass field with ``default`` whose values must lie in ``rng`` (checked by
    ``build_section``, after the type; a tuple's range applies to each value)."""
    return dataclasses.field(default=default, metadata={RANGE: rng})


def key_fields(cls) -> dict[str, dataclasses.Field]:
    """The fields of config dataclass ``cls`` (a class or an instance) that are keys a file may
    set, by name: every field but those marked ``DERIVED``."""
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get(DERIVED)}


def field_range(cls, name: str) -> Range | None:
    """The Range declared on field ``name`` of dataclass ``cls`` (None: none)."""
    return next((f.metadata.get(RANGE) for f in dataclasses.fields(cls) if f.name == name), None)


def range_error(key: str, value: Any, rng: Range | None) -> str | None:
    """Why ``value`` is outside ``rng`` (None when inside, or when there is no range)."""
    if rng is None or value is None:
        return None
    for i, v in enumerate(value) if isinstance(value, tuple) else [(None, value)]:
        if v not in rng:
            name = key if i is None else f"{key}[{i}]"
            return f"{name} must be {'an int ' if isinstance(v, int) else ''}{rng}, got {v!r}"
    return None


def check_ranges(cfg, prefix: str) -> None:
    """Each field of dataclass instance ``cfg`` inside its declared ``Range`` (``ranged``), for a
    config built directly (``build_section`` checks the same on the way in from a file)."""
    for f in dataclasses.fields(cfg):
        why = range_error(f"{prefix}.{f.name}", getattr(cfg, f.name), f.metadata.get(RANGE))
        if why:
            raise ConfigError(why)


def check_fields(cfg, prefix: str) -> None:
    """Each field of dataclass instance ``cfg`` of its declared type and inside its ``Range``, as
    ``build_section`` checks a section read from a file: a config built in Python gets the same
    messages. A value the hint converts (an int for a float, a list for a tuple) is stored so."""
    hints = typing.get_type_hints(type(cfg))  # resolved (the annotations may be strings)
    for f in dataclasses.fields(cfg):
        object.__setattr__(cfg, f.name, check_type(f"{prefix}.{f.name}", getattr(cfg, f.name), hints[f.name]))
    check_ranges(cfg, prefix)


def check_type(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a simple type hint (int, float, bool, str, list, dict, tuple[X, ...],
    X | None, X | Y (the first that takes it), Literal[...] choices); floats must be finite."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) == 1:
            return check_type(key, value, kinds[0])
        errors = []
        for a in kinds:  # X | Y: the first that takes the value
            try:
                return check_type(key, value, a)
            except ConfigError as e:
                errors.append((a, e))
        shaped = [e for a, e in errors if isinstance(value, _takes(a))]
        if len(shaped) == 1:  # the one alternative of the value's kind says what is wrong inside it
            raise shaped[0]
        names = " or ".join(_described(a) for a in kinds)
        raise ConfigError(f"{key}: expected {names}, got {type(value).__name__} {value!r}")
    if hint is Any:
        return value
    if origin is typing.Literal:  # a choice: the message names them all
        if value not in typing.get_args(hint) or isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not one of {typing.get_args(hint)}")
        return value
    base = origin or hint
    if base is tuple and isinstance(value, list):
        value = tuple(value)
    if base is tuple and isinstance(value, tuple) and typing.get_args(hint):
        args = typing.get_args(hint)
        if args[-1] is Ellipsis:
            args = args[:1] * len(value)
        elif len(value) != len(args):
            raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}: {list(value)!r}")
        return tuple(check_type(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if base in (int, float) and isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
        # a numpy number (a sweep's np.arange, a computed lr) as the Python number it is; not an
        # integral float for an int (1.0 steps is a mistake a file would not make either)
        value = int(value) if isinstance(value, numbers.Integral) else float(value) if base is float else value
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # 10**400: past every float
            raise ConfigError(f"{key}: expected a finite number, got an integer of {len(str(value))} digits") from None
    if base is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value}")
    if value is None:  # `key:` or `--set key=` with nothing after it: YAML's null
        raise ConfigError(f"{key}: is empty (YAML null: nothing after the ':' or '='); expected "
                          f"{_a(getattr(base, '__name__', str(base)))}")
    if base is int and isinstance(value, bool) or not isinstance(value, base):
        quote = (" (YAML read the value as a mapping or a list: ': ', '{', '[' in it; put it in YAML quotes, '...')"
                 if isinstance(value, (dict, list)) and base is str else "")
        raise ConfigError(f"{key}: expected {getattr(base, '__name__', base)}, got "
                          f"{type(value).__name__} {value!r}{quote}")
    return value


def _takes(hint: Any) -> tuple[type, ...]:
    """The Python types of the values ``hint`` is about (a list for a tuple, a choice's own)."""
    origin = typing.get_origin(hint) or hint
    if origin is typing.Literal:
        return tuple({type(v) for v in typing.get_args(hint)})
    if origin is tuple:
        return (tuple, list)
    return (origin,) if isinstance(origin, type) else ()


def _described(hint: Any) -> str:
    """``int``, ``one of ('a', 'b')``, ``a list``: an alternative of a union as a message names it."""
    origin = typing.get_origin(hint) or hint
    if origin is typing.Literal:
        return f"one of {typing.get_args(hint)}"
    if origin is tuple:
        return "a list"
    return getattr(hint, "__name__", str(hint))


def _a(name: str) -> str:
    return {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
            "dict": "a mapping", "list": "a list", "tuple": "a list"}.get(name, name)


def near_miss(key: str, known) -> str:
    """', did you mean X?' for a near miss, else ''."""
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def _none_as_empty(cls, name: str, value: Any, hint: Any) -> Any:
    """YAML null (``profile:``, ``profile: null``, ``--set dispatch.profile=null``) for a string
    key whose default is empty (empty: none, off) reads as that empty string."""
    if value is None and hint is str:
        default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        if default == "":
            return ""
    return value


def build_section(cls, section: str, data: Any, *, hint: Callable[[str, Any], str] = near_miss):
    """Instantiate dataclass ``cls`` from a mapping, naming unknown keys, wrong types and values
    outside a field's Range as ``section.key``. ``hint``: what an unknown key may have meant."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            raise ConfigError(f"{section}.{k}: unknown key{hint(k, fields)} (known: {sorted(fields)})")
    kwargs = {k: check_type(f"{section}.{k}", _none_as_empty(cls, k, v, hints[k]), hints[k])
              for k, v in data.items()}
    for k, v in kwargs.items():
        why = range_error(f"{section}.{k}", v, fields[k].metadata.get(RANGE))
        if why is not None:
            raise ConfigError(why)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(section) else f"{section}: {msg}") from e
