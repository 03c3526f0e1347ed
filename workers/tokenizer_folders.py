"""How transformers 5 reads a model folder's tokenizer (``Tokenizer.load``, workers/tokenizer.py):
the named special tokens of tokenizer_config.json and special_tokens_map.json with the tokenizer
class's defaults, and the pipeline transformers imposes over tokenizer.json's for the folders it
loads as ``Qwen2Tokenizer`` or ``LlamaTokenizer`` (docs/trainer.md, "Tokenizer")."""
from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from workers.tokenizer_registry import GENERIC_BACKEND_MODEL_TYPES, OVERRIDDEN_HUB_CLASS_MODEL_TYPES

SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # older folders' named special tokens
# config.json model types that transformers 5 loads as Qwen2Tokenizer when tokenizer_config.json
# names no tokenizer_class ("qwen2" whatever it names)
QWEN2_TOKENIZER_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next")
# the special tokens Qwen2Tokenizer / LlamaTokenizer take when the folder names none (the key absent
# from tokenizer_config.json and special_tokens_map.json; a key set to null stays unset)
QWEN2_DEFAULT_TOKENS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
LLAMA_DEFAULT_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
# the named special tokens transformers hands a chat template (those that are set)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_folder(folder: Path, as_transformers: bool = True) -> tuple[_HFTokenizer, dict, dict]:
    """(the tokenizer, its named special tokens, tokenizer_config.json) of a model folder, as
    transformers 5 reads them; ``as_transformers=False``: tokenizer.json's own pipeline, as saved."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a model folder needs tokenizer.json")
    cfg = _read_json(folder / "tokenizer_config.json")
    config = _read_json(folder / "config.json") if as_transformers else {}  # (read once, for both rules)
    qwen2 = as_transformers and uses_qwen2_tokenizer(folder, cfg, config)
    llama = as_transformers and not qwen2 and uses_llama_tokenizer(folder, cfg, config)
    defaults = QWEN2_DEFAULT_TOKENS if qwen2 else LLAMA_DEFAULT_TOKENS if llama else None
    tokens = folder_special_tokens(folder, cfg, defaults=defaults)
    if not tokens.get("eos_token"):
        raise ValueError(f"{folder}: no eos_token in {folder / 'tokenizer_config.json'} or "
                         f"{folder / SPECIAL_TOKENS_MAP_FILE}; name the model's end-of-sequence token there")
    tok = _HFTokenizer.from_file(str(path))
    if qwen2:
        _impose_qwen2_pipeline(tok, path, add_prefix_space=bool(cfg.get("add_prefix_space")))
    elif llama:
        _impose_llama_pipeline(tok, path, add_prefix_space=cfg.get("add_prefix_space"),
                               legacy=cfg.get("legacy", False))
    if as_transformers:
        # (tokenizer.json's post-processor is kept: with a tokenizer.json, transformers drops
        # tokenizer_config.json's add_bos_token / add_eos_token)
        _add_special_tokens(tok, [tokens.get(name) for name in SPECIAL_TOKEN_NAMES] + extra_special_tokens(folder, cfg))
    return tok, tokens, cfg


def _read_json(path: Path) -> dict:
    """A folder's optional JSON file ({} when absent); a file that is not a JSON object is refused."""
    if not path.exists():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except (OSError, ValueError) as e:  # a folder of that name, not UTF-8, a number past Python's digit limit
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def folder_special_tokens(folder: str | os.PathLike, cfg: dict | None = None,
                          defaults: dict[str, str] | None = None) -> dict[str, str | None]:
    """The named special tokens (``SPECIAL_TOKEN_NAMES``) of a model folder, as transformers reads
    them: tokenizer_config.json's, and, when it has no ``added_tokens_decoder`` (older folders),
    special_tokens_map.json's entries win over them (a string or an ``{"content": ...}`` dict).
    ``defaults``: the tokenizer class's own (``QWEN2_DEFAULT_TOKENS``, ``LLAMA_DEFAULT_TOKENS``),
    for the names neither file has (a name given as null stays None, as transformers passes it)."""
    folder = Path(folder)
    if cfg is None:
        cfg = _read_json(folder / "tokenizer_config.json")
    where = folder / "tokenizer_config.json"
    tokens = {k: _token_str(cfg.get(k), where, k) for k in SPECIAL_TOKEN_NAMES}
    named = {k for k in SPECIAL_TOKEN_NAMES if k in cfg}
    if "added_tokens_decoder" not in cfg:
        legacy = _read_json(folder / SPECIAL_TOKENS_MAP_FILE)
        tokens.update({k: _token_str(legacy[k], folder / SPECIAL_TOKENS_MAP_FILE, k)
                       for k in SPECIAL_TOKEN_NAMES if k in legacy})
        named |= {k for k in SPECIAL_TOKEN_NAMES if k in legacy}
    for k, v in (defaults or {}).items():
        if k not in named:
            tokens[k] = v
    return tokens


def _token_str(t, where: Path, name: str) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts (null: none);
    anything else is refused, naming the file and key (an id there failed deep in tokenizers)."""
    text = t.get("content") if isinstance(t, dict) else t
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: {name} must be the token's text (or {{\"content\": text}}), got {t!r:.60}")
    return text


def uses_qwen2_tokenizer(folder: str | os.PathLike, cfg: dict | None = None, config: dict | None = None) -> bool:
    """Whether transformers 5's ``AutoTokenizer`` loads the folder as ``Qwen2Tokenizer``: always
    for config.json's ``model_type: qwen2`` (whatever ``tokenizer_class`` says), for a
    ``tokenizer_class`` Qwen2Tokenizer(Fast), and for the other Qwen model types that name no
    ``tokenizer_class``. ``cfg`` / ``config``: tokenizer_config.json / config.json, when read
    already."""
    folder = Path(folder)
    if cfg is None:
        cfg = _read_json(folder / "tokenizer_config.json")
    if config is None:
        config = _read_json(folder / "config.json")
    model_type = config.get("model_type")
    tokenizer_class = cfg.get("tokenizer_class")
    if model_type == "qwen2" or tokenizer_class in ("Qwen2Tokenizer", "Qwen2TokenizerFast"):
        return True
    return tokenizer_class is None and model_type in QWEN2_TOKENIZER_MODEL_TYPES


def uses_llama_tokenizer(folder: str | os.PathLike, cfg: dict | None = None, config: dict | None = None) -> bool:
    """Whether transformers 5's ``AutoTokenizer`` loads the folder as ``LlamaTokenizer`` (which
    imposes its own pipeline, ``_impose_llama_pipeline``): ``tokenizer_class`` (tokenizer_config.json's,
    else config.json's) LlamaTokenizer(Fast), a tokenizer.json with no ``"ByteLevel"`` in it (Llama 3
    style folders that still name LlamaTokenizer are read as tokenizer.json says), and a config.json
    ``model_type`` that transformers registers with no generic backend (llama, none, yi, deepseek,
    gemma, ...: workers/tokenizer_registry.py; mistral, phi3, internlm2, ... are read as saved).
    Qwen2 folders (``uses_qwen2_tokenizer``) are not; nor are the few other model types whose hub
    class transformers overrides (qwen3_5: its own tokenizer class, read here as saved)."""
    folder = Path(folder)
    if cfg is None:
        cfg = _read_json(folder / "tokenizer_config.json")
    if config is None:
        config = _read_json(folder / "config.json")
    if uses_qwen2_tokenizer(folder, cfg, config):
        return False
    declared = cfg.get("tokenizer_class") or config.get("tokenizer_class")
    if not isinstance(declared, str) or declared.removesuffix("Fast") != "LlamaTokenizer":
        return False
    model_type = config.get("model_type")
    if model_type in GENERIC_BACKEND_MODEL_TYPES or model_type in OVERRIDDEN_HUB_CLASS_MODEL_TYPES:
        return False
    path = folder / "tokenizer.json"
    return not (path.is_file() and '"ByteLevel"' in path.read_text(encoding="utf-8"))


def _impose_llama_pipeline(tok: _HFTokenizer, path: Path, add_prefix_space=None, legacy=False) -> None:
    """LlamaTokenizer's pipeline over tokenizer.json's (its vocab, merges, added tokens and
    post-processor are kept), as transformers 5 builds it: no normalizer (a SentencePiece-style
    Prepend/Replace one is dropped), a Metaspace pre-tokenizer ("▁" for spaces, split=False) that
    prepends "▁" to the first piece of text only (``legacy`` false, the default) or to each piece
    between special tokens (``legacy`` true), or never (``add_prefix_space`` false; None is true),
    a byte-fallback BPE (fuse_unk; no dropout, unknown token, affixes or ignore_merges), and the
    decoder undoing it (the leading space stripped when a prefix is added)."""
    model = tok.model
    if not isinstance(model, models.BPE):
        raise ValueError(f"{path}: a {type(model).__name__} model, but transformers 5 loads this folder as "
                         "LlamaTokenizer (tokenizer_class), which rebuilds it as a BPE from its vocabulary "
                         "without merges and tokenizes differently from the model's training; refused")
    add_prefix_space = True if add_prefix_space is None else add_prefix_space
    model.dropout, model.unk_token = None, None
    model.continuing_subword_prefix, model.end_of_word_suffix = None, None
    model.fuse_unk, model.byte_fallback, model.ignore_merges = True, True, False
    tok.normalizer = None
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)


def _add_special_tokens(tok: _HFTokenizer, texts) -> None:
    """As transformers' TokenizersBackend does on loading: each of ``texts`` (the named special
    tokens, the extra ones) that is not one of tokenizer.json's added tokens becomes a special
    added token (split out of any text and skipped in decoding; a new id when it is not in the
    vocabulary either), and one added as non-special is marked special (transformers' decode
    skips every special token's id, whatever tokenizer.json says of it)."""
    special = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    for t in texts:
        if t and not special.get(t, False):
            tok.add_special_tokens([AddedToken(t, special=True)])
            special[t] = True


def extra_special_tokens(folder: Path, cfg: dict) -> list[str]:
    """tokenizer_config.json's ``additional_special_tokens`` / ``extra_special_tokens`` (a list of
    strings or ``{"content"}`` dicts, or a name -> token mapping), and special_tokens_map.json's
    when the config has no ``added_tokens_decoder``: transformers 5 adds each as a special token
    (``<tool_call>`` one id, not its bytes: prompt ids differed from transformers'; review, s53)."""
    sources = [cfg] if "added_tokens_decoder" in cfg else [cfg, _read_json(folder / SPECIAL_TOKENS_MAP_FILE)]
    out = []
    for src in sources:  # transformers 5 takes extra_special_tokens, additional_special_tokens without it
        for key in ("extra_special_tokens",) if src.get("extra_special_tokens") else ("additional_special_tokens",):
            value = src.get(key) or []
            for t in (value.values() if isinstance(value, dict) else value if isinstance(value, list) else []):
                t = t.get("content") if isinstance(t, dict) else t  # (anything but text: skipped)
                if isinstance(t, str) and t and t not in out:
                    out.append(t)
    return out


def _impose_qwen2_pipeline(tok: _HFTokenizer, path: Path, add_prefix_space: bool = False) -> None:
    """Qwen2Tokenizer's pipeline over tokenizer.json's (its vocab, merges, added tokens and
    post-processor are kept): NFC, the ``QWEN2_SPLIT`` pre-tokenizer then bytes, a byte-level
    decoder, and a plain BPE (no dropout, unknown token, affixes, byte fallback or ignore_merges)."""
    model = tok.model
    if not isinstance(model, models.BPE):
        raise ValueError(f"{path}: a {type(model).__name__} model, but transformers loads this folder as "
                         "Qwen2Tokenizer, which needs a BPE tokenizer.json")
    model.dropout, model.unk_token = None, None
    model.continuing_subword_prefix, model.end_of_word_suffix = None, None
    model.fuse_unk, model.byte_fallback, model.ignore_merges = False, False, False
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = qwen2_pre_tokenizer(add_prefix_space)
    tok.decoder = decoders.ByteLevel()


# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer, Qwen2.5's tokenizer.json): digits one
# by one, letters in runs with one leading non-letter, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen2_pre_tokenizer(add_prefix_space: bool = False):
    """Qwen2Tokenizer's pre-tokenizer: the ``QWEN2_SPLIT`` pieces, then their bytes."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])
