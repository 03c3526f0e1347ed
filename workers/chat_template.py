"""Chat templates, as transformers 5 finds and renders them.

* ``find(folder, tokenizer_config)``: a model folder's template (``chat_template.jinja``,
  ``additional_chat_templates/<name>.jinja``, else tokenizer_config.json's ``chat_template``;
  of named ones "tool_use" when ``tools`` are given, else "default").
* ``render(template, messages, add_generation_prompt, context)``: the text of
  ``apply_chat_template(..., tokenize=False)``, in transformers' jinja2 sandbox.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Sequence

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' names for a folder's template files
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# the names a message's reasoning goes by; transformers fills "thinking" and "reasoning_content" from any
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render(template: str, messages: Sequence[dict], add_generation_prompt: bool, context: dict) -> str:
    """``template`` rendered over ``messages`` (as transformers hands them over) with the
    ``context`` variables (special tokens, tools, documents, the caller's kwargs)."""
    return compile_template(template).render(messages=template_messages(messages),
                                             add_generation_prompt=add_generation_prompt, **context)


@lru_cache(maxsize=16)
def compile_template(template: str):
    """Compile in the environment transformers' ``apply_chat_template`` uses (5.x): an immutable
    sandbox with trim_blocks + lstrip_blocks, the ``loopcontrols`` extension (``{% break %}``,
    ``{% continue %}``) and a ``{% generation %}`` block (rendered as its body: it only marks the
    assistant's tokens for masks, which this project does not ask for); the globals
    ``raise_exception``, ``strftime_now`` (the local time, e.g. Llama 3's "Today Date"),
    a ``dict`` and a ``namespace`` that refuse underscore names; a ``tojson`` that keeps non-ASCII
    characters and takes indent / separators / sort_keys."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        raise ImportError(f"chat templates need jinja2 >= 3.1.6 (as transformers does: older ones have "
                          f"sandbox escapes), found {jinja2.__version__}")

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def no_underscore(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set the underscore attribute {name!r} on a namespace")

    class SafeNamespace(Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 - Namespace's own signature (a "self" key is allowed)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                no_underscore(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            no_underscore(name)
            Namespace.__setitem__(self, name, value)

    class SafeDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=SafeDict(),
                       namespace=SafeNamespace)
    return env.from_string(template)


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped (a
    template tests ``'tool_calls' in message``), a reasoning given under any of its names also
    under ``thinking`` and ``reasoning_content``."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def find(folder: str | os.PathLike, tokenizer_config: dict, tools: Sequence[dict] = ()) -> str | None:
    """A model folder's chat template, found as transformers 5 finds it: the files
    ``chat_template.jinja`` (named "default") and ``additional_chat_templates/<name>.jinja``, when
    there are any, win over tokenizer_config.json's ``chat_template`` (a string, or a list of
    ``{"name", "template"}``). Of several named templates, as transformers' ``get_chat_template``
    picks for ``apply_chat_template(..., tools=tools)``: "tool_use" when ``tools`` are given (the
    prompts show tool schemas) and there is one, else "default"; none of those is refused, as
    transformers' ``apply_chat_template`` refuses it."""
    folder, cfg = Path(folder), tokenizer_config
    named: dict[str, str] = {}
    files: dict[str, Path] = {}  # name -> the file it was read from
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = folder / CHAT_TEMPLATE_FILE
    if (folder / CHAT_TEMPLATE_DIR).is_dir():
        for f in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f
    named = {name: f.read_text(encoding="utf-8") for name, f in files.items()}
    where = f"{folder / CHAT_TEMPLATE_FILE} / {folder / CHAT_TEMPLATE_DIR}"
    if not named:
        t = cfg.get("chat_template")
        where = f"{folder / 'tokenizer_config.json'} chat_template"
        if t is None or isinstance(t, str):
            return _compiles(t, where)
        if not isinstance(t, list) or not all(isinstance(d, dict) and "name" in d and "template" in d for d in t):
            raise ValueError(f"{where}: expected a template string or a list of "
                             f'{{"name": ..., "template": ...}}, got {type(t).__name__}')
        named = {d["name"]: d["template"] for d in t}
    pick = "tool_use" if tools and "tool_use" in named else "default"
    if pick not in named:
        raise ValueError(f"{where}: the chat templates {sorted(named)} include none named 'default' (the one "
                         "transformers' apply_chat_template uses when given no name"
                         f"{'' if tools else ' and no tools'}); name one 'default'")
    return _compiles(named[pick], str(files[pick]) if pick in files else f"{where} {pick!r}")


def _compiles(template: str | None, where: str) -> str | None:
    """``template``, once it compiles: a syntax error is said naming the file (or config key) and
    line when the folder is read, not as the first prompt's failure to render (review, s53)."""
    if template is not None:
        import jinja2

        try:
            compile_template(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{where}:{e.lineno}: the chat template does not compile: {e.message}") from None
    return template
