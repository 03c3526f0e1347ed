"""Tokenizer: a ``tokenizer.json`` (``tokenizers`` library) plus prompt formatting.

Files in a model folder, as Hugging Face lays them out (read as transformers 5 reads them by
``workers/tokenizer_folders.py``):
* ``tokenizer.json`` — the fast tokenizer (any model the ``tokenizers`` library reads). A folder
  that transformers 5 loads as ``Qwen2Tokenizer`` (config.json's ``model_type: qwen2``, ...: see
  ``uses_qwen2_tokenizer``) is tokenized with Qwen2's NFC normalizer and split pre-tokenizer, as
  transformers imposes them whatever tokenizer.json says; one it loads as ``LlamaTokenizer``
  (``tokenizer_class`` LlamaTokenizer(Fast) over a SentencePiece-style tokenizer.json: see
  ``uses_llama_tokenizer``) with LlamaTokenizer's Metaspace pipeline (``legacy``,
  ``add_prefix_space``) in place of tokenizer.json's normalizer.
* ``tokenizer_config.json`` — ``eos_token``, ``pad_token``, ``bos_token`` and optionally
  ``chat_template`` (jinja2, rendered as ``transformers.apply_chat_template`` does) or our own
  ``prompt_template`` (a ``str.format`` template with ``{prompt}``).
* ``special_tokens_map.json`` — older folders' named special tokens: as in transformers, its
  entries win over tokenizer_config.json's when that has no ``added_tokens_decoder``. Names
  neither file has take the Qwen2Tokenizer / LlamaTokenizer defaults where transformers loads the
  folder as one; named special tokens that are no added token of tokenizer.json become special
  added tokens, as in transformers. A folder left with no ``eos_token`` is refused.
* ``chat_template.jinja`` (and ``additional_chat_templates/<name>.jinja``) — where transformers 5's
  ``save_pretrained`` writes the chat template; as in transformers, these files win over
  tokenizer_config.json's ``chat_template``, and of several named templates "tool_use" is used
  when the prompts show tools (``Tokenizer.load(tools=...)``) and there is one, else "default".

``train_bpe`` builds a tiny byte-level BPE in-process (tests and the quickstart: no hub).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from workers.chat_template import find as find_chat_template
from workers.chat_template import render as render_chat_template
from workers.tokenizer_folders import qwen2_pre_tokenizer, read_folder

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_PROMPT_TEMPLATE = "{prompt}\n"




def check_prompt_template(template: str) -> None:
    """A prompt template is a ``str.format`` template whose one field is ``{prompt}``; other
    braces are written doubled (``{{ }}``). Raises ValueError saying what is wrong."""
    import string

    if not isinstance(template, str):
        raise ValueError(f"must be a str.format template with a {{prompt}} field, got {template!r:.60}")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:  # a lone "{" or "}"
        raise ValueError(f"{template!r} is not a str.format template ({e}); write literal braces "
                         "as {{ and }}") from None
    other = sorted({"{" + f + "}" for f in fields if f != "prompt"})
    if other:
        raise ValueError(f"{template!r} has the field(s) {', '.join(other)}, but only {{prompt}} is filled "
                         "in (it is a str.format template); write literal braces as {{ and }}")
    if "prompt" not in fields:
        raise ValueError(f"{template!r} must contain '{{prompt}}'")
    try:
        template.format(prompt="")
    except (ValueError, KeyError, IndexError, AttributeError) as e:  # e.g. a format spec: {prompt:d}
        raise ValueError(f"{template!r}: formatting {{prompt}} fails ({e})") from None


class Tokenizer:
    """``encode(str) -> list[int]``, ``decode(ids) -> str``, ``format_prompt(text) -> str``.

    ``chat_template`` (jinja2) wins over ``prompt_template`` (``str.format`` with ``{prompt}``).
    ``tools`` (OpenAI function schemas, ``multi_turn.tools``) are what a chat template renders
    into every prompt (its ``tools`` variable); without a template they are not shown.
    ``template_kwargs`` (``tokenizer.chat_template_kwargs``, verl's ``apply_chat_template_kwargs``:
    ``{enable_thinking: false}``) are variables every rendering of the chat template sees."""

    def __init__(self, tok: _HFTokenizer, eos_token: str = EOS_TOKEN, pad_token: str | None = PAD_TOKEN,
                 bos_token: str | None = None, chat_template: str | None = None,
                 prompt_template: str | None = None, special_tokens: dict[str, str] | None = None,
                 tools: Sequence[dict] = (), template_kwargs: dict | None = None):
        self.tok = tok
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, bos_token
        # other named special tokens (unk_token, sep_token, ...): a chat template sees them as
        # transformers passes them
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items()
                               if v is not None and k not in ("eos_token", "pad_token", "bos_token")}
        self.chat_template = chat_template
        self.tools = list(tools)
        self.template_kwargs = dict(template_kwargs or {})
        self.prompt_template = prompt_template or DEFAULT_PROMPT_TEMPLATE
        try:
            check_prompt_template(self.prompt_template)
        except ValueError as e:
            raise ValueError(f"prompt_template: {e}") from None
        self.eos_id = self._token_id(eos_token, "eos_token")
        self.pad_id = self._token_id(pad_token, "pad_token") if pad_token else self.eos_id
        self.bos_id = self._token_id(bos_token, "bos_token") if bos_token else None

    def _token_id(self, token: str, what: str) -> int:
        i = self.tok.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer: {what} {token!r} is not in the vocabulary")
        return i

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: with what tokenizer.json's
        post-processor adds (a Llama tokenizer's BOS), as transformers' ``tokenizer(text)``."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int] | Iterable[int], skip_special_tokens: bool = True) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def format_prompt(self, text: str, messages: Sequence[dict] = ()) -> str:
        """The text a model sees for a user prompt (or a whole chat, ``messages``), ending where
        the answer starts, with the ``tools`` the chat template renders (none: ``tools=None``, as
        before). Without a chat template a chat is its turns' contents, blank-line separated, in
        the prompt template."""
        if self.chat_template:
            tools = {"tools": self.tools} if self.tools else {}
            return self.apply_chat_template(list(messages or ()) or [{"role": "user", "content": text}],
                                            add_generation_prompt=True, **tools)
        if messages:
            text = "\n\n".join(str(m.get("content") or "") for m in messages)
        return self.prompt_template.format(prompt=text)

    def encode_prompt(self, text: str, messages: Sequence[dict] = ()) -> list[int]:
        """Token ids of a prompt (or a chat) as the policy sees it: ``format_prompt``, encoded.
        A chat template writes its own special tokens (``{{ bos_token }}``): encoded without
        more, as transformers' ``apply_chat_template(tokenize=True)``; a plain template's text
        gets what the tokenizer adds to any text (BOS for Llama), as ``tokenizer(text)`` and
        vLLM's ``generate(str)`` do."""
        return self.encode(self.format_prompt(text, messages), add_special_tokens=not self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat rendered as ``transformers``' ``apply_chat_template(..., tokenize=False)``: the
        template sees ``messages``, ``tools`` and ``documents`` (None unless given),
        ``add_generation_prompt``, the special tokens that are set (``bos_token``, ...),
        ``template_kwargs`` and ``kwargs`` (which win, in that order)."""
        if not self.chat_template:
            raise ValueError("tokenizer has no chat template (chat_template.jinja or tokenizer_config.json's "
                             "chat_template)")
        tokens = {**self.special_tokens, "bos_token": self.bos_token, "eos_token": self.eos_token,
                  "pad_token": self.pad_token}
        context = {k: v for k, v in tokens.items() if v is not None}
        context.update(tools=None, documents=None)
        context.update(self.template_kwargs)
        context.update(kwargs)
        return render_chat_template(self.chat_template, messages, add_generation_prompt, context)

    # ---- files -----------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(folder / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eos_token,
               "pad_token": self.pad_token, "bos_token": self.bos_token,
               "prompt_template": self.prompt_template, "model_max_length": 1 << 20}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike, prompt_template: str | None = None,
             as_transformers: bool = True, tools: Sequence[dict] = (),
             template_kwargs: dict | None = None, chat_template: bool = True) -> "Tokenizer":
        """A model folder's tokenizer, as transformers 5's ``AutoTokenizer`` reads it: the named
        special tokens from tokenizer_config.json and special_tokens_map.json
        (``folder_special_tokens``, with the class's defaults), and, where transformers loads the
        folder as its ``Qwen2Tokenizer`` (``uses_qwen2_tokenizer``) or ``LlamaTokenizer``
        (``uses_llama_tokenizer``), that class's pipeline over tokenizer.json's
        (``workers/tokenizer_folders.py``: ``read_folder``).
        ``as_transformers=False``: tokenizer.json's own pipeline, as saved (a folder this
        project wrote and reads back itself, e.g. the LM ranker's GPT-2-split tokenizer).
        ``tools``: the schemas its prompts show (``Tokenizer.tools``); they also pick a folder's
        named "tool_use" chat template over "default", as transformers' ``apply_chat_template(tools=...)``.
        ``template_kwargs``: variables every rendering sees (``Tokenizer.template_kwargs``).
        ``chat_template=False``: the folder's chat templates are not read (a tokenizer that only
        encodes and decodes text, as the trainer's: a folder whose only template is "tool_use"
        formats prompts only with tools)."""
        tok, tokens, cfg = read_folder(Path(folder), as_transformers)
        return cls(tok, eos_token=tokens["eos_token"], pad_token=tokens.get("pad_token"),
                   bos_token=tokens.get("bos_token"),
                   chat_template=find_chat_template(Path(folder), cfg, tools) if chat_template else None,
                   prompt_template=prompt_template or cfg.get("prompt_template"),
                   special_tokens=tokens, tools=tools, template_kwargs=template_kwargs)


def min_bpe_vocab(special_tokens: Sequence[str] = (EOS_TOKEN, PAD_TOKEN)) -> int:
    """The smallest ``vocab_size`` ``train_bpe`` takes: the 256 byte symbols and the special tokens."""
    return 256 + len(special_tokens)


def train_bpe(texts: Iterable[str], vocab_size: int = 512, special_tokens: Sequence[str] = (EOS_TOKEN, PAD_TOKEN),
              min_frequency: int = 2, chat_template: str | None = None,
              prompt_template: str | None = None, split: str = "qwen2") -> Tokenizer:
    """Train a byte-level BPE on ``texts`` in-process, by default (``split="qwen2"``) with
    Qwen2's normalizer (NFC) and pre-tokenizer (``QWEN2_SPLIT``, then bytes). transformers 5 loads any ``model_type: qwen2``
    folder's tokenizer as its ``Qwen2Tokenizer``, which imposes that pipeline over what
    tokenizer.json says: with GPT-2's split instead, transformers (and vLLM) would tokenize the
    saved model's text differently from this project. ``split="gpt2"``: GPT-2's byte-level
    split (numbers stay whole, so BPE can merge them), for tokenizers never saved as a
    policy's (the ranker's small LM reads sizes and counts better that way).

    The first special token is EOS, the second (if any) PAD. All 256 byte symbols are in the
    alphabet, so any text encodes."""
    if vocab_size < min_bpe_vocab(special_tokens):
        raise ValueError(f"train_bpe: vocab_size {vocab_size} < 256 bytes + {len(special_tokens)} special tokens")
    if not special_tokens:
        raise ValueError("train_bpe: special_tokens must name at least the EOS token")
    tok = _HFTokenizer(models.BPE())
    if split == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = qwen2_pre_tokenizer()
    elif split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        raise ValueError(f"train_bpe: split {split!r} is not 'qwen2' or 'gpt2'")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(special_tokens), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, eos_token=special_tokens[0],
                     pad_token=special_tokens[1] if len(special_tokens) > 1 else None,
                     chat_template=chat_template, prompt_template=prompt_template)
