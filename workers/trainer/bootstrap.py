"""Build a tiny model folder from scratch for a task: byte-level BPE trained on the task's
texts, a randomly initialised Qwen2-style model, an optional SFT warm-start, saved in HF format
with the tokenizer files (what the engine, the trainer and the quickstart load)."""
from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained
from workers.tokenizer import Tokenizer, train_bpe
from workers.trainer.sft import SFTResult, sft_warmstart
from workers.types import Task

TINY = ModelConfig(vocab_size=384, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   tie_word_embeddings=True)


def build_tokenizer(task: Task, vocab_size: int, prompt_template: str | None = None) -> Tokenizer:
    texts = []
    for item in task.prompts("train"):
        texts.append(item.prompt)
        texts.extend(m["content"] for m in item.messages if m.get("content"))  # a system turn: text the policy sees
        texts.append(item.answer)
    return train_bpe(texts, vocab_size=vocab_size, prompt_template=prompt_template)


def build_model_dir(folder: str | os.PathLike, task: Task, model_cfg: ModelConfig = TINY,
                    sft_steps: int = 0, sft_batch_size: int = 32, sft_lr: float = 1e-3, seed: int = 0,
                    eval_items: int = 0, prompt_template: str | None = None,
                    log_every: int = 0) -> tuple[Path, SFTResult]:
    """-> (folder, SFT result). ``model_cfg.vocab_size`` sets the BPE vocabulary size; EOS and
    PAD ids are written into config.json."""
    torch.manual_seed(seed)
    tok = build_tokenizer(task, model_cfg.vocab_size, prompt_template)
    if tok.vocab_size < model_cfg.vocab_size:  # said, not silent: config.json's vocab_size is the smaller one
        print(f"[bootstrap] the BPE learned {tok.vocab_size} tokens of the {model_cfg.vocab_size} asked "
              "(model.init's vocab_size): the task's texts hold no more merges; the model is built with "
              f"vocab_size {tok.vocab_size}", file=sys.stderr, flush=True)
    cfg = ModelConfig(**{**asdict(model_cfg), "vocab_size": tok.vocab_size, "eos_token_id": tok.eos_id})
    model = init_weights(CausalLM(cfg), seed=seed)
    result = SFTResult()
    if sft_steps > 0 or eval_items > 0:
        result = sft_warmstart(model, tok, task, sft_steps, batch_size=sft_batch_size, lr=sft_lr, seed=seed,
                               eval_items=eval_items, log_every=log_every)
    folder = Path(folder)
    tmp_tok = folder.parent / f".{folder.name}.tok"
    tok.save(tmp_tok)
    save_pretrained(model, folder, extra_files=[tmp_tok / "tokenizer.json", tmp_tok / "tokenizer_config.json"])
    for f in tmp_tok.iterdir():
        f.unlink()
    tmp_tok.rmdir()
    return folder, result
