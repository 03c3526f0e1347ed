"""A model folder's tokenizer files read as transformers 5 reads them, and refused where they
cannot be used, naming the file (review, session 53): tokenizer_config.json's extra special
tokens, a chat template that does not compile, a generation_config.json that is no JSON object
or names no token id; and prompts the start check refuses (one rendered to no tokens), or takes
(a TaskPrompt whose ``messages`` is None). Folders are written in-process (no hub)."""
import json
import os

import pytest

from controller.prompt_fit import fitting_prompts
from workers.model import stop_ids
from workers.tokenizer import Tokenizer, train_bpe
from workers.types import TaskPrompt

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
TEXTS = ["sum 12345 678 2", "3+5=8; 8+2=10; answer=10", "hello world 2024", "call a tool now"] * 20
SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, vocab_size=300, special_tokens=SPECIALS)


def _folder(path, bpe, files=(), **config):
    bpe.save(path)
    cfg = {**json.loads((path / "tokenizer_config.json").read_text()), **config}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 0}))
    for name, text in dict(files).items():
        (path / name).write_text(text)
    return path


@pytest.mark.parametrize("key", ["additional_special_tokens", "extra_special_tokens"])
def test_extra_special_tokens_are_one_id_each_as_in_transformers(tmp_path, bpe, key):
    """``<tool_call>`` was encoded as its bytes: prompt ids differed from transformers'."""
    transformers = pytest.importorskip("transformers")
    path = _folder(tmp_path, bpe, **{key: ["<tool_call>"]})
    ours, theirs = Tokenizer.load(path), transformers.AutoTokenizer.from_pretrained(str(path))
    ids = theirs.encode("call <tool_call> now", add_special_tokens=False)
    assert ours.encode("call <tool_call> now") == ids and len(ids) < len("call <tool_call> now")
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_an_extra_special_token_added_as_plain_is_made_special_and_extra_wins(tmp_path, bpe):
    """One tokenizer.json lists as a non-special added token: transformers' decode skips it
    (every special token's id), ours kept it; with both lists, transformers 5 takes
    extra_special_tokens only (review of the change above)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    path = _folder(tmp_path, bpe, additional_special_tokens=["<tool_call>"])
    raw = HFTokenizer.from_file(str(path / "tokenizer.json"))
    raw.add_tokens([AddedToken("<tool_call>", special=False)])
    raw.save(str(path / "tokenizer.json"))
    ours, theirs = Tokenizer.load(path), transformers.AutoTokenizer.from_pretrained(str(path))
    ids = theirs.encode("call <tool_call> now", add_special_tokens=False)
    assert ours.encode("call <tool_call> now") == ids
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "call  now"
    both = _folder(tmp_path / "both", bpe, additional_special_tokens=["<a_tok>"], extra_special_tokens=["<b_tok>"])
    ours, theirs = Tokenizer.load(both), transformers.AutoTokenizer.from_pretrained(str(both))
    assert ours.encode("x <a_tok> <b_tok>") == theirs.encode("x <a_tok> <b_tok>", add_special_tokens=False)


def test_a_chat_template_that_does_not_compile_names_its_file_and_line(tmp_path, bpe):
    """It was found by the first prompt's rendering, naming that prompt."""
    path = _folder(tmp_path, bpe, files={"chat_template.jinja": "{% for m in messages %}\n{{ m.content + }}\n{% endfor %}"})
    with pytest.raises(ValueError, match=r"chat_template.jinja:2: the chat template does not compile: "):
        Tokenizer.load(path)


@pytest.mark.parametrize("text, said", [('{"eos_token_id": [3, 1],}', "not valid JSON"),
                                        ("[]", "expected a JSON object, got list"),
                                        ('{"eos_token_id": [3, null]}', "eos_token_id must be a token id")])
def test_a_bad_generation_config_is_named(tmp_path, bpe, text, said):
    path = _folder(tmp_path, bpe, files={"generation_config.json": text})
    with pytest.raises(ValueError, match=rf"generation_config.json: {said}"):
        stop_ids(path, 0)


def test_stop_ids_outside_the_vocabulary_are_named_at_start(tmp_path, bpe):
    """An ``eos_token`` tokenizer.json lacks gets a new id past the vocabulary (as transformers
    adds it): it passed the start checks and every generation rank died naming ``engine.eos_ids``,
    a key a run config refuses (review, s55). Named now, with the file; so is a config's
    ``eos_token_id`` past ``vocab_size``."""
    import json

    path = _folder(tmp_path, bpe)
    vocab = 40
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 0, "vocab_size": vocab}))
    with pytest.raises(ValueError, match=rf"tokenizer_config.json: the eos_token has id {vocab}, outside the "
                                         rf"model's vocabulary \[0, {vocab}\)"):
        stop_ids(path, vocab)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, vocab + 3]}))
    with pytest.raises(ValueError, match=rf"generation_config.json: eos_token_id must be a token id of the "
                                         rf"model's vocabulary \[0, {vocab}\)"):
        stop_ids(path, 0)


@pytest.mark.parametrize("config, said", [
    ({"eos_token": 5}, r"tokenizer_config.json: eos_token must be the token's text \(or \{\"content\": text\}\), got 5"),
    ({"pad_token": {"content": 7}}, r"tokenizer_config.json: pad_token must be the token's text"),
    ({"prompt_template": 5}, r"prompt_template: must be a str.format template with a \{prompt\} field, got 5")])
def test_a_special_token_or_prompt_template_that_is_no_text_is_named(tmp_path, bpe, config, said):
    """An id given as the eos_token, a number as the prompt template: TypeErrors from deep inside
    tokenizers, a traceback on every rank (review, s55)."""
    with pytest.raises(ValueError, match=said):
        Tokenizer.load(_folder(tmp_path, bpe, **config))


def test_a_prompt_the_template_renders_to_nothing_is_refused_and_none_messages_are_no_chat(tmp_path, bpe):
    """A template rendering only 'user' turns, given ShareGPT's 'human': kept by the start check
    (0 tokens), then refused by the engine mid-run, which stopped the run. ``messages=None`` was
    refused as "the prompt template cannot render it" (list(None))."""
    template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% endif %}{% endfor %}"
    tok = Tokenizer.load(_folder(tmp_path, bpe, chat_template=template))
    items = [TaskPrompt("sum 3 5", "8", "t", messages=None),
             TaskPrompt("sum 1 2", "3", "t", messages=[{"role": "human", "content": "sum 1 2"}])]
    with pytest.raises(ValueError, match=r"\[1\] .*the template renders it to no tokens"):
        fitting_prompts(items, lambda it: tok.encode_prompt(it.prompt, it.messages), 64, "train", "error")
    kept, _ = fitting_prompts(items[:1], lambda it: tok.encode_prompt(it.prompt, it.messages), 64, "train", "error")
    assert kept == items[:1] and tok.format_prompt("sum 3 5", None) == "sum 3 5\n"
