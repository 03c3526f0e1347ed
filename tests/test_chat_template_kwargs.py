"""``tokenizer.chat_template_kwargs`` (verl's ``data.apply_chat_template_kwargs``): variables every
rendering of the chat template sees, as transformers' ``apply_chat_template(..., **kwargs)``
(Qwen3's ``enable_thinking: false``); and a folder's named "tool_use" template, which the prompts
of a run with tools use, used by the engines' observations too (a real run:
tests/test_multi_turn_run.py)."""
import json
import re

import pytest

from controller.config import ConfigError, load_config
from controller.config_sections import MultiTurnSection
from workers.generation import factory
from workers.generation.observations import observation_ids
from workers.tasks.envs.tools import run_tools
from workers.tokenizer import Tokenizer, train_bpe

SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Qwen3's switch, cut down: a generation prompt with an empty think block when thinking is off
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
TOOL_USE = ("{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}"
            "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}"
            "\n</tool_response><|im_end|>\n{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(["what is 2 + 3? think answer tool result " * 4] * 20, vocab_size=320, special_tokens=SPECIALS)


def _folder(tok, path, default=None, tool_use=None):
    tok.save(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    if default is not None:
        (path / "chat_template.jinja").write_text(default)
    if tool_use is not None:
        (path / "additional_chat_templates").mkdir()
        (path / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    return path


def test_the_variables_reach_prompts_and_observations_as_transformers_renders(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = _folder(bpe, tmp_path / "m", default=THINKING)
    chat = [{"role": "user", "content": "what is 2 + 3?"}]
    off = Tokenizer.load(folder, template_kwargs={"enable_thinking": False})
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.format_prompt("", chat) == want and want.endswith("<think>\n\n</think>\n\n")
    assert Tokenizer.load(folder).format_prompt("", chat) == \
        hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)  # thinking on: none given
    # an observation's turn ends with the next generation prompt: the empty think block too
    obs = off.decode(observation_ids(off, {"role": "tool", "content": "5"}), skip_special_tokens=False)
    assert obs == "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # a call's own keyword wins
    assert "<think>" not in off.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=True)


def test_the_config_key_and_verls_name(tmp_path):
    cfg = load_config("configs/quickstart.yaml", overrides=["tokenizer.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.tokenizer.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match=re.escape("verl's 'apply_chat_template_kwargs' is tokenizer.chat_template_kwargs")):
        load_config("configs/quickstart.yaml", overrides=["task.apply_chat_template_kwargs={enable_thinking: false}"])
    with pytest.raises(ConfigError, match=re.escape("tokenizer.chat_template_kwargs: 'tools' is set by the run "
                                                    "itself (multi_turn.tools); leave it out")):
        load_config("configs/quickstart.yaml", overrides=["tokenizer.chat_template_kwargs={tools: []}"])
    with pytest.raises(ConfigError, match=r"tokenizer.chat_template_kwargs: key True \(bool\) is not a name"):
        load_config("configs/quickstart.yaml", overrides=["tokenizer.chat_template_kwargs={on: 1}"])


def test_an_engine_without_the_controllers_tokenizer_renders_with_the_tools_template(bpe, tmp_path):
    """The instances loaded the folder's tokenizer without the run's tools: its "default" template
    rendered the observations while the prompts used "tool_use"; a folder with only "tool_use"
    did not start. The trainer, which only decodes, reads no template (``chat_template=False``)."""
    section = MultiTurnSection(env="calculator")
    tools = run_tools(section)
    msg = {"role": "tool", "content": "56"}
    for name, default in (("both", THINKING), ("tool_use_only", None)):
        folder = _folder(bpe, tmp_path / name, default=default, tool_use=TOOL_USE)
        prompts = Tokenizer.load(folder, tools=tools)
        engine = factory._multi_turn(object(), str(folder), section)
        assert engine.tokenizer.chat_template == prompts.chat_template == TOOL_USE
        assert observation_ids(engine.tokenizer, msg) == observation_ids(prompts, msg)
        given = factory._multi_turn(object(), str(folder), section, prompts)
        assert given.tokenizer is prompts
    with pytest.raises(ValueError, match="include none named 'default'"):
        Tokenizer.load(tmp_path / "tool_use_only")  # prompts without tools: transformers refuses it too
    assert Tokenizer.load(tmp_path / "tool_use_only", chat_template=False).chat_template is None
