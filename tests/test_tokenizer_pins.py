"""Tokenizer and chat-template behaviour one-line mutations changed unnoticed (mutation review,
session 57), each against transformers: indented block tags, a template reading `thinking`, a
given prompt template over the folder's, a Qwen2 folder's add_prefix_space."""
import json

import pytest

from workers.tokenizer import Tokenizer, train_bpe

transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")

TEXTS = ["sum 3 5 2", "3+5=8; 8+2=10; answer=10", "hello world", "count 9 by 3"] * 20
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum 3 5"},
        {"role": "assistant", "content": "8", "reasoning_content": "3 plus 5"}, {"role": "user", "content": "sum 1 2"}]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXTS, vocab_size=300, special_tokens=("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"))


def folder_with(tok, path, chat_template=None, model_type="llama", **cfg_extra):
    Tokenizer(tok.tok, eos_token=tok.eos_token, pad_token=tok.pad_token).save(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    cfg.update(cfg_extra)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def hf_render(folder, msgs, gen=True):
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    return hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


# block tags indented without "-": lstrip_blocks strips the indentation before them (transformers' env)
INDENTED = ("{% for m in messages %}\n"
            "    {% if m.role == 'user' %}\n"
            "U: {{ m.content }}\n"
            "    {% else %}\n"
            "{{ m.role }}: {{ m.content }}\n"
            "    {% endif %}\n"
            "{% endfor %}\n"
            "{% if add_generation_prompt %}A:{% endif %}")


def test_indented_block_tags_render_as_transformers(tok, tmp_path):
    folder = folder_with(tok, tmp_path / "ind", INDENTED)
    ours = Tokenizer.load(folder)
    for gen in (True, False):
        assert ours.apply_chat_template(MSGS, add_generation_prompt=gen) == hf_render(folder, MSGS, gen)


def test_reasoning_content_reaches_a_template_reading_thinking(tok, tmp_path):
    """transformers hands a message's reasoning to the template under both names."""
    template = "{% for m in messages %}[{{ m.role }}|{{ m.thinking }}|{{ m.reasoning_content }}]{% endfor %}"
    folder = folder_with(tok, tmp_path / "think", template)
    got = Tokenizer.load(folder).apply_chat_template(MSGS)
    assert got == hf_render(folder, MSGS)
    assert "[assistant|3 plus 5|3 plus 5]" in got


def test_a_given_prompt_template_wins_over_the_folders(tok, tmp_path):
    """tokenizer.prompt_template of the run config (session.py passes it to load) wins over the
    prompt_template that Tokenizer.save writes into every folder it makes (model.init, checkpoints)."""
    Tokenizer(tok.tok, eos_token=tok.eos_token, prompt_template="Q: {prompt}\nA:").save(tmp_path)
    assert Tokenizer.load(tmp_path).format_prompt("x") == "Q: x\nA:"
    assert Tokenizer.load(tmp_path, prompt_template="[{prompt}]").format_prompt("x") == "[x]"


def test_qwen2_folder_with_add_prefix_space_tokenizes_as_transformers(tok, tmp_path):
    folder = folder_with(tok, tmp_path / "q", model_type="qwen2", add_prefix_space=True)
    ours, hf = Tokenizer.load(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for text in ("hello world", "sum 3 5", "count"):
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
