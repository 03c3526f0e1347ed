"""Tool schemas in the prompt (``multi_turn.tools``, or the environment's ``TOOLS``): read and
checked at config load, and rendered through the chat template's ``tools`` into every prompt the
controller encodes (``Program.prompt_ids``); without tools, prompts are what they were."""
import json
from types import SimpleNamespace

import pytest

from controller.config import ConfigError, from_dict
from controller.program import Program
from controller.prompt_check import tools_without_template_note
from workers.tasks.envs.calculator import TOOLS as CALCULATOR_TOOLS
from workers.tasks.envs.tools import run_tools
from workers.tokenizer import Tokenizer, train_bpe
from workers.types import TaskPrompt

SPECIAL = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# ChatML with a system block listing the tools, as Qwen's templates do
CHATML_TOOLS = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                "<|im_end|>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "find a word",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
ITEM = TaskPrompt("what is 3 * 9?", "27", "sum")


def _error(d: dict) -> str:
    with pytest.raises(ConfigError) as e:
        from_dict(d)
    return str(e.value)


def _on(tools: str = "", env: str = "calculator") -> dict:
    return {"multi_turn": {"env": env, "tools": tools}}


def _tokenizer(tmp_path, cfg, chat_template: str | None = CHATML_TOOLS) -> Tokenizer:
    """The policy's tokenizer as the session loads it: the folder's, with the run's tools."""
    tok = train_bpe(["what is the answer", '{"type": "function", "name": "calculator"}'] * 20, vocab_size=320,
                    special_tokens=SPECIAL, chat_template=chat_template)
    folder = tok.save(tmp_path / "tok")
    return Tokenizer.load(folder, tools=run_tools(cfg.multi_turn))


def _program(cfg, tok) -> Program:
    world = SimpleNamespace(sgs=SimpleNamespace(stream_window_s=0))
    return Program(cfg, world, tok, SimpleNamespace(prompts=lambda split: [ITEM] * 4))


# ---- config -------------------------------------------------------------------------------
def test_the_tools_come_from_a_file_or_the_envs_TOOLS(tmp_path):
    assert from_dict({}).multi_turn.tools == "" and run_tools(from_dict({}).multi_turn) == []
    assert run_tools(from_dict(_on()).multi_turn) == CALCULATOR_TOOLS  # the built-in env's own
    assert CALCULATOR_TOOLS[0]["function"]["name"] == "calculator"
    listed = tmp_path / "tools.json"
    listed.write_text(json.dumps([LOOKUP]))
    assert run_tools(from_dict(_on(str(listed))).multi_turn) == [LOOKUP]  # the file wins over the env's
    verl = tmp_path / "tool_config.yaml"  # verl's tool_config_path shape: each entry's tool_schema
    verl.write_text("tools:\n  - class_name: my.tools.Lookup\n    config: {type: native}\n    tool_schema:\n"
                    "      type: function\n      function:\n        name: lookup\n        description: find a word\n"
                    "        parameters: {type: object, properties: {q: {type: string}}}\n")
    assert run_tools(from_dict(_on(str(verl))).multi_turn) == [LOOKUP]
    (tmp_path / "env.py").write_text(f"class Env:\n    TOOLS = [{LOOKUP!r}]\n\n"
                                     "    def __call__(self, task, messages):\n        return None\n\n\n"
                                     "def plain(task, messages):\n    return None\n")
    assert run_tools(from_dict(_on(env=f"{tmp_path / 'env.py'}:Env")).multi_turn) == [LOOKUP]
    assert run_tools(from_dict(_on(env=f"{tmp_path / 'env.py'}:plain")).multi_turn) == []


def test_bad_tools_are_named_at_load(tmp_path):
    missing = tmp_path / "nope.json"
    msg = _error(_on(str(missing)))
    assert msg.startswith(f"multi_turn.tools: {missing} is not a file")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert _error(_on(str(bad))).startswith(f"multi_turn.tools: {bad}: not valid JSON")
    bad.write_text(json.dumps({"name": "lookup"}))
    assert "a dict, not a list of tool schemas" in _error(_on(str(bad)))
    bad.write_text(json.dumps([LOOKUP, {"type": "function", "function": {"description": "no name"}}]))
    msg = _error(_on(str(bad)))
    assert msg.startswith(f"multi_turn.tools: {bad}: entry 1 has no function.name")
    bad.write_text(json.dumps([LOOKUP, LOOKUP]))
    assert "entries 0 and 1 are both named 'lookup'" in _error(_on(str(bad)))
    bad.write_text(json.dumps([{**LOOKUP, "type": "retrieval"}]))
    assert "entry 0 ('lookup') has type 'retrieval'" in _error(_on(str(bad)))
    verl = tmp_path / "tool_config.yaml"
    verl.write_text("tools:\n  - class_name: my.tools.Lookup\n    config: {}\n")  # no tool_schema
    assert _error(_on(str(verl))).startswith(f"multi_turn.tools: {verl}: entry 0 has no function.name")
    (tmp_path / "env.py").write_text("def env(task, messages):\n    return None\n\n\nenv.TOOLS = {'a': 1}\n")
    assert "multi_turn.env" in _error(_on(env=f"{tmp_path / 'env.py'}:env"))  # the env's own TOOLS
    listed = tmp_path / "tools.json"
    listed.write_text(json.dumps([LOOKUP]))
    assert _error({"multi_turn": {"tools": str(listed)}}).startswith("multi_turn.tools:")  # no env: nothing answers


# ---- prompts ------------------------------------------------------------------------------
def test_the_prompts_the_program_encodes_show_the_tools(tmp_path):
    cfg = from_dict(_on())
    tok = _tokenizer(tmp_path, cfg)
    assert tok.tools == CALCULATOR_TOOLS
    ids = _program(cfg, tok).prompt_ids(ITEM).tolist()
    text = tok.decode(ids, skip_special_tokens=False)
    assert json.dumps(CALCULATOR_TOOLS[0], ensure_ascii=False) in text
    assert text.startswith("<|im_start|>system\n# Tools\n") and text.endswith(
        "<|im_start|>user\nwhat is 3 * 9?<|im_end|>\n<|im_start|>assistant\n")
    # the start check encodes as the program does (the same tokenizer): the lengths it checks are these
    assert tok.encode_prompt(ITEM.prompt, ITEM.messages) == ids
    assert all(r.prompt_ids.tolist() == ids for r in _program(cfg, tok).make_batch(0).requests)


def test_without_tools_the_prompts_are_unchanged(tmp_path):
    for cfg in (from_dict({}), from_dict(_on(env=_plain_env(tmp_path)))):  # single-turn; an env without TOOLS
        tok = _tokenizer(tmp_path, cfg)
        assert tok.tools == []
        ids = _program(cfg, tok).prompt_ids(ITEM).tolist()
        # the template sees tools=None, as before this key existed
        assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(
            [{"role": "user", "content": ITEM.prompt}], add_generation_prompt=True) == \
            "<|im_start|>user\nwhat is 3 * 9?<|im_end|>\n<|im_start|>assistant\n"


def _plain_env(tmp_path) -> str:
    (tmp_path / "plain.py").write_text("def env(task, messages):\n    return None\n")
    return f"{tmp_path / 'plain.py'}:env"


def test_without_a_chat_template_the_tools_are_noted_and_left_out(tmp_path):
    cfg = from_dict(_on())
    tok = _tokenizer(tmp_path, cfg, chat_template=None)
    plain = _tokenizer(tmp_path, from_dict({}), chat_template=None)
    assert _program(cfg, tok).prompt_ids(ITEM).tolist() == _program(cfg, plain).prompt_ids(ITEM).tolist()
    note = tools_without_template_note(tok.tools, bool(tok.chat_template))
    assert note.startswith("multi_turn.tools:") and "no chat template" in note and "(calculator)" in note
    assert tools_without_template_note(tok.tools, True) is None and tools_without_template_note([], False) is None
