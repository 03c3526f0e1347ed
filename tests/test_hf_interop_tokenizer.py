"""Chat templates as transformers 5 finds and renders them: ``chat_template.jinja`` (what its
``save_pretrained`` writes) and named templates, and the jinja environment (loopcontrols,
``strftime_now``, ``{% generation %}``, namespace, the special tokens handed over). Every case is
compared with ``AutoTokenizer.apply_chat_template`` on the same folder."""
import json
from datetime import datetime

import pytest

from workers.chat_template import find as find_chat_template
from workers.tokenizer import Tokenizer, train_bpe

transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")

TEXTS = ["sum 3 5 2", "3+5=8; 8+2=10; answer=10", "hello world", "count 9 by 3"] * 20
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum 3 5"},
        {"role": "assistant", "content": "8"}, {"role": "user", "content": "sum 1 ü 2"}]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(TEXTS, vocab_size=300, special_tokens=("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"))


def folder_with(tok, path, chat_template=None, **cfg_extra):
    """A tokenizer folder (tokenizer_config.json holding ``chat_template`` if given) with a
    config.json, as a model folder has (AutoTokenizer reads its model_type)."""
    t = Tokenizer(tok.tok, eos_token=tok.eos_token, pad_token=tok.pad_token, chat_template=None)
    t.save(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    cfg.update(cfg_extra)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return path


def hf_render(folder, msgs, gen=True):
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    return hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def test_chat_template_jinja_written_by_transformers_is_read(tok, tmp_path):
    """transformers 5's save_pretrained writes the template to chat_template.jinja, not into
    tokenizer_config.json: Tokenizer.load read only the JSON and fell back to "{prompt}\\n"."""
    src = folder_with(tok, tmp_path / "src", CHATML)
    hf = transformers.AutoTokenizer.from_pretrained(src)
    out = tmp_path / "saved"
    hf.save_pretrained(out)
    assert (out / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    (out / "config.json").write_text((src / "config.json").read_text())
    ours = Tokenizer.load(out)
    assert ours.chat_template == CHATML
    assert ours.format_prompt("sum 3 5") == hf_render(out, [{"role": "user", "content": "sum 3 5"}])
    for gen in (True, False):
        assert ours.apply_chat_template(MSGS, add_generation_prompt=gen) == hf_render(out, MSGS, gen)


def test_chat_template_jinja_wins_over_tokenizer_config(tok, tmp_path):
    folder = folder_with(tok, tmp_path / "m", "CONFIG {{ messages[0]['content'] }}")
    (folder / "chat_template.jinja").write_text("JINJA {{ messages[0]['content'] }}")
    msgs = [{"role": "user", "content": "x"}]
    assert Tokenizer.load(folder).apply_chat_template(msgs) == hf_render(folder, msgs) == "JINJA x"


def test_named_templates_default_is_used_and_none_default_refused(tok, tmp_path):
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT {{ 1 + 1 }}"}]
    folder = folder_with(tok, tmp_path / "list", named)
    msgs = [{"role": "user", "content": "x"}]
    assert Tokenizer.load(folder).apply_chat_template(msgs) == hf_render(folder, msgs) == "DEFAULT 2"

    # the files' form: additional_chat_templates/<name>.jinja beside chat_template.jinja
    files = folder_with(tok, tmp_path / "files", "IGNORED")
    (files / "chat_template.jinja").write_text("FILE DEFAULT")
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "rag.jinja").write_text("RAG")
    assert Tokenizer.load(files).apply_chat_template(msgs) == hf_render(files, msgs) == "FILE DEFAULT"

    # several without a "default": transformers' apply_chat_template refuses; so does load
    nodefault = folder_with(tok, tmp_path / "nodefault", [{"name": "a", "template": "A"},
                                                         {"name": "b", "template": "B"}])
    with pytest.raises(ValueError, match=r"tokenizer_config.json chat_template.*\['a', 'b'\].*'default'"):
        Tokenizer.load(nodefault)
    with pytest.raises(ValueError, match="default"):
        hf_render(nodefault, msgs)
    config = json.loads((tmp_path / "list" / "tokenizer_config.json").read_text())
    assert find_chat_template(tmp_path / "list", config) == "DEFAULT {{ 1 + 1 }}"


LOOPCTL = ("{% for m in messages %}{% if m.role == 'system' %}{{ '[SYS]' + m.content }}{% continue %}{% endif %}"
           "{{ '[' + m.role + ']' + m.content }}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
LLAMA_DATE = ("{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
              "{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}"
              "{%- endif %}{%- endif %}Today Date: {{ date_string }}\n{% for m in messages %}{{ m['content'] }}"
              "{% endfor %}")
GENERATION = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}A:{{ m.content }}{% endgeneration %}"
              "{% else %}U:{{ m.content }}{% endif %}\n{% endfor %}")
NAMESPACE = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
             "{{ ns.n }} {{ dict(a=1) | tojson }} {{ messages | tojson }}")
TOKENS = ("[{{ bos_token is defined }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}|"
          "{{ tools is none }}|{{ documents is none }}|{{ 'tool_calls' in messages[0] }}|"
          "{{ messages[0].reasoning_content }}]")


@pytest.mark.parametrize("name,template", [("loopcontrols", LOOPCTL), ("strftime_now", LLAMA_DATE),
                                           ("generation", GENERATION), ("namespace_dict_tojson", NAMESPACE)])
def test_jinja_environment_matches_transformers(tok, tmp_path, name, template):
    """{% continue %} / {% break %} raised TemplateSyntaxError here; strftime_now was undefined,
    so Llama 3.2's template wrote a fixed "26 Jul 2024" where transformers writes today's date."""
    folder = folder_with(tok, tmp_path / name, template)
    ours = Tokenizer.load(folder)
    for gen in (True, False):
        assert ours.apply_chat_template(MSGS, add_generation_prompt=gen) == hf_render(folder, MSGS, gen)
    if name == "strftime_now":  # the date before or after rendering (a render across midnight)
        before = datetime.now().strftime("%d %b %Y")
        text = ours.format_prompt("hi")
        assert before in text or datetime.now().strftime("%d %b %Y") in text


def test_template_sees_what_transformers_hands_it(tok, tmp_path):
    """Only the special tokens that are set are defined (bos_token was "" here before), tools and
    documents are None, None-valued message keys are dropped, reasoning is aliased."""
    folder = folder_with(tok, tmp_path / "tokens", TOKENS)
    msgs = [{"role": "assistant", "content": "x", "tool_calls": None, "reasoning": "because"}]
    got = Tokenizer.load(folder).apply_chat_template(msgs)
    assert got == hf_render(folder, msgs)
    assert got == "[False|<|endoftext|>|<|pad|>|False|True|True|False|because]"


def test_namespace_refuses_underscore_names(tok, tmp_path):
    folder = folder_with(tok, tmp_path / "ns", "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    from jinja2.exceptions import SecurityError
    with pytest.raises(SecurityError):
        Tokenizer.load(folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_plain_template_prompt_gets_the_bos_the_tokenizer_adds_as_transformers(tmp_path):
    # a Llama base model: no chat template, tokenizer.json's post-processor adds BOS to any
    # text (transformers' tokenizer(text), vLLM's generate(str)); a chat template writes its
    # own {{ bos_token }}, so the chat path must not add a second one
    from tokenizers import processors
    transformers = pytest.importorskip("transformers")
    bos = "<|begin_of_text|>"
    base = train_bpe(["Question: What is 2 + 3?\nAnswer: 5"] * 40, vocab_size=300,
                     special_tokens=("<|end_of_text|>", bos))
    bid = base.tok.token_to_id(bos)
    base.tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bid)])])
    plain = Tokenizer(base.tok, eos_token="<|end_of_text|>", pad_token=None, bos_token=bos,
                      prompt_template="Question: {prompt}\nAnswer: ")
    plain.save(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours, hf = Tokenizer.load(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = ours.encode_prompt("What is 2 + 3?")
    assert ids[0] == bid and ids.count(bid) == 1
    assert ids == hf(ours.format_prompt("What is 2 + 3?"))["input_ids"]
    chat = Tokenizer(base.tok, eos_token="<|end_of_text|>", pad_token=None, bos_token=bos,
                     chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat.encode_prompt("What is 2 + 3?").count(bid) == 1
