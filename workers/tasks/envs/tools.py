"""Tool schemas shown to the policy (``multi_turn.tools``; docs/multi_turn.md).

verl renders its tools' OpenAI function schemas into the prompt through the chat template's
``tools`` argument (transformers' ``apply_chat_template(messages, tools=[...])``); so does this
project, for every prompt the controller encodes (``Tokenizer.tools``). The schemas come from
``multi_turn.tools``, a JSON or YAML file holding either

* a list of schemas, ``{"type": "function", "function": {"name", "description", "parameters"}}``;
* verl's ``tool_config_path`` file, ``{"tools": [{"class_name": ..., "config": ...,
  "tool_schema": {...}}]}``: each entry's ``tool_schema`` is taken (the rest is verl's tool
  class, which this project does not build: the environment answers the calls);

or, when the key is empty, from the environment's ``TOOLS`` attribute (a list of schemas; the
built-in ``calculator`` has one). Every failure is one ValueError naming the source and the
entry's index.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KEY = "multi_turn.tools"


def read_tools(path: str) -> list[dict]:
    """The schemas of a ``multi_turn.tools`` file (JSON or YAML, by its suffix)."""
    where = f"{KEY}: {path}"
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{where} is not a file (relative paths are from the current directory)")
    try:
        text = file.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read it ({e})") from None
    try:
        data = json.loads(text) if file.suffix.lower() == ".json" else _yaml(text)
    except ValueError as e:
        raise ValueError(f"{where}: not valid {'JSON' if file.suffix.lower() == '.json' else 'YAML'} ({e})") from None
    if isinstance(data, dict) and "tools" in data:  # verl's tool_config: each entry's tool_schema
        entries = data["tools"]
        if isinstance(entries, list):
            data = [e["tool_schema"] if isinstance(e, dict) and "tool_schema" in e else e for e in entries]
        else:
            data = entries
    return check_tools(data, where)


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def check_tools(tools: Any, where: str) -> list[dict]:
    """``tools`` if it is a list of OpenAI function schemas with distinct names, JSON-serialisable
    (a chat template renders them with ``tojson``); else a ValueError naming ``where`` and the entry."""
    if not isinstance(tools, list):
        raise ValueError(f"{where}: a {type(tools).__name__}, not a list of tool schemas ({{\"type\": \"function\", "
                         "\"function\": {\"name\": ..., \"description\": ..., \"parameters\": ...}}}, or verl's "
                         "tool_config {\"tools\": [{\"tool_schema\": ...}]})")
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: entry {i} has no function.name ({str(tool)[:120]}); a tool schema is "
                             "{\"type\": \"function\", \"function\": {\"name\": ..., \"description\": ..., "
                             "\"parameters\": ...}}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}: entry {i} ({name!r}) has type {tool['type']!r}; an OpenAI tool schema's "
                             "type is 'function'")
        if name in names:
            raise ValueError(f"{where}: entries {names[name]} and {i} are both named {name!r}")
        names[name] = i
        try:
            json.dumps(tool)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: entry {i} ({name!r}) is not JSON data ({e})") from None
    return tools


def run_tools(section) -> list[dict]:
    """The schemas a run's prompts show (``section``: its ``multi_turn`` section): the file
    ``tools`` names, else the environment's ``TOOLS`` (a function's attribute or a class's), else
    none; none in a single-turn run."""
    if not section.env:
        return []
    if section.tools:
        return read_tools(section.tools)
    from workers.tasks.envs import load_env

    listed = getattr(load_env(section.env), "TOOLS", None)
    if listed is None:
        return []
    return check_tools(listed, f"multi_turn.env ({section.env!r})'s TOOLS")
