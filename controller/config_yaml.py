"""A run config's YAML text -> plain data. PyYAML reads YAML 1.1, which accepts silently what a
user does not mean; each is refused here naming the key and the line: a key given twice (the
last one won), and a plain number with a leading zero or a colon (``010`` read as octal 8,
``1:30`` as base 60, 90). The file itself must be a readable UTF-8 file, not a folder."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from controller.config_types import ConfigError

_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"
_OCTAL = re.compile(r"[-+]?0[0-7_]+")  # YAML 1.1's octal int (``0`` alone is zero)


def read_config_file(path: Path) -> Any:
    """The data of YAML file ``path`` (None when it is empty); ``ConfigError`` naming it otherwise."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder, not a YAML file (give --config FILE.yaml)")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e.strerror or e})") from None
    utf16 = raw.startswith((b"\xff\xfe", b"\xfe\xff"))  # a BOM: YAML allows UTF-16 (Windows editors write it)
    try:
        text = raw.decode("utf-16" if utf16 else "utf-8-sig")
    except UnicodeDecodeError as e:
        line = e.object.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not {'UTF-16' if utf16 else 'UTF-8'} (byte 0x{e.object[e.start]:02x}); "
                          "save the file as UTF-8, e.g. iconv -f <its encoding> -t utf-8 (latin1 for Western "
                          "European text)") from None
    try:
        return load_checked(text, "", str(path))
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error_line(str(path), e)) from e
    except ConfigError:
        raise
    except (ValueError, RecursionError) as e:  # a number past Python's digit limit, nesting past its depth
        raise ConfigError(f"config file {path}: cannot be read ({type(e).__name__}: {str(e)[:120]})") from None


def yaml_error_line(where: str, e: yaml.YAMLError) -> str:
    """``e`` as one ``WHERE:LINE:COLUMN: invalid YAML: what`` line (PyYAML's own text spans
    several lines and names the text "<unicode string>")."""
    mark, started = getattr(e, "problem_mark", None), getattr(e, "context_mark", None)
    context = getattr(e, "context", None)
    if context and started is not None and (mark is None or started.line != mark.line):
        context += f" (line {started.line + 1})"  # where the unclosed thing began
    what = "; ".join(str(x) for x in (context, getattr(e, "problem", None)) if x)
    mark = mark or started
    if mark is None or not what:
        return f"{where}: invalid YAML: {' '.join(str(e).split())}"
    return f"{where}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {what}"


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-5`` as the float YAML 1.2 (and every HF config) means:
    YAML 1.1 needs a dot (``1.0e-5``), so ``1e-5`` was a string, converted for typed keys but
    passed on as text inside ``model.init``, ``task.kwargs``, ``ranker.options``,
    ``dispatch.options`` (``rms_norm_eps: 1e-5`` in a built model's config.json; review, s53)."""


class Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper with ``Loader``'s floats: a string ``"1e3"`` is written quoted (plain,
    it would load back as the float 1000.0: the run's record of ``logging.experiment: "1e3"``
    was refused on reload; review, s53)."""


def dump(data, **kwargs) -> str:
    """``yaml.safe_dump`` through ``Dumper``: what it writes, ``load_checked`` reads back the same."""
    return yaml.dump(data, Dumper=Dumper, **kwargs)


_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")
for _cls in (Loader, Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+.0123456789"))


def load_checked(text: str, key: str, where: str) -> Any:
    """``yaml.safe_load(text)`` (with ``Loader``'s floats), parsed once and ``check_node``-ed
    before its data is built (a file, or a ``--set`` value for ``key``); a YAML syntax error is
    raised as ``yaml.YAMLError``."""
    loader = Loader(text)
    try:
        node = loader.get_single_node()
        check_node(node, key, where)
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def check_node(node: yaml.Node | None, key: str, where: str) -> None:
    """Raise ``ConfigError`` ``where:LINE: KEY: ...`` for a duplicate key or a number YAML 1.1
    reads in another base, anywhere under ``node`` (at dotted ``key``)."""
    seen: set[int] = set()

    def at(n: yaml.Node) -> str:
        return f"{where}:{n.start_mark.line + 1}" if where and not where.startswith("--set") else where

    def walk(n: yaml.Node, path: str) -> None:
        if id(n) in seen:  # an alias of a node already checked
            return
        seen.add(id(n))
        if isinstance(n, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for k, v in n.value:
                if k.tag == _MERGE:  # '<<: *anchor': its keys may be overridden here, by design
                    walk(v, path)
                    continue
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                dotted = f"{path}.{name}" if path else str(name)
                if isinstance(k, yaml.ScalarNode):
                    if (k.tag, k.value) in lines:
                        raise ConfigError(f"{at(k)}: {dotted}: given twice (lines {lines[k.tag, k.value]} and "
                                          f"{k.start_mark.line + 1}); YAML would keep only the last: remove one")
                    lines[k.tag, k.value] = k.start_mark.line + 1
                walk(v, dotted)
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, f"{path}[{i}]")
        elif isinstance(n, yaml.ScalarNode) and n.style is None and n.tag in (_INT, _FLOAT):
            text, name = n.value, path or "value"
            if n.tag == _INT and _OCTAL.fullmatch(text) and yaml.safe_load(text) != int(_decimal(text)):  # 07 is 7
                raise ConfigError(f"{at(n)}: {name}: {text} would read as octal ({yaml.safe_load(text)}) in YAML "
                                  f"1.1; write it without the leading zero ({_decimal(text)}), or quote it for a string")
            if ":" in text:
                raise ConfigError(f"{at(n)}: {name}: {text} would read as a base-60 number "
                                  f"({yaml.safe_load(text)}) in YAML 1.1; quote it for a string")

    if node is not None:
        walk(node, key)


def _decimal(text: str) -> str:
    """``-010`` -> ``-10``: the number a leading-zero int was meant to be."""
    sign = text[0] if text[0] in "+-" else ""
    return sign + (text.lstrip("+-").replace("_", "").lstrip("0") or "0")
