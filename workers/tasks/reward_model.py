"""A model-based reward: a Hugging Face sequence-classification model (``Qwen2ForSequenceClassification``
or ``LlamaForSequenceClassification``, one label) scores each (prompt, completion) by its logit at
the last token, as transformers' ``...ForSequenceClassification`` does (verl's ``reward_model``
worker). Named as a verifier: ``task.kwargs: {verifier: reward_model, verifier_kwargs: {path:
RM_FOLDER}}``; a batch of samples is one packed forward (the task gets ``score_batch``).

The text scored is the chat ``[user: prompt (or the prompt's messages), assistant: completion]``
through the reward model's own chat template, without a generation prompt; without a template,
the prompt followed by the completion. The model is loaded on first use, on the scoring rank's
device (bf16 on a GPU, fp32 on the CPU): building the task where it only lists prompts (the
controller) loads nothing."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from torch import nn

from workers.model import Backbone, CausalAttention, RotaryEmbedding, default_device, default_dtype, load_state
from workers.model_config import ModelConfig
from workers.types import TaskPrompt

ARCHITECTURES = {"Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                 "LlamaForSequenceClassification": "LlamaForCausalLM"}


class SequenceScorer(nn.Module):
    """Backbone + ``score`` head [labels, hidden], HF names (``model.*``, ``score.weight``)."""

    def __init__(self, cfg: ModelConfig, labels: int):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.score = nn.Linear(cfg.hidden_size, labels, bias=False)

    def forward(self, seqs: list[torch.Tensor]) -> torch.Tensor:
        """Token id sequences -> their last token's logits [B, labels] (float32)."""
        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(len(s), device=ids.device) for s in seqs])
        ends = torch.tensor([len(s) for s in seqs], device=ids.device).cumsum(0)
        hidden = self.model(ids, pos, CausalAttention([0, *ends.tolist()]))
        return self.score(hidden[ends - 1]).float()


def load_scorer(folder: str | Path, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> SequenceScorer:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: a reward model folder needs config.json")
    d = json.loads(cfg_path.read_text())
    arch = (d.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{cfg_path}: architecture {arch!r} is not a reward model this project runs "
                         f"({sorted(ARCHITECTURES)})")
    labels = int(d.get("num_labels") or len(d.get("id2label") or {}) or 1)
    if labels != 1:
        raise ValueError(f"{cfg_path}: {labels} labels; a reward model has one (its logit is the reward)")
    cfg = ModelConfig.from_hf({**d, "architectures": [ARCHITECTURES[arch]]}, cfg_path)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = SequenceScorer(cfg, labels)
    model = model.to_empty(device=device)
    state = {k: v for k, v in load_state(folder).items() if "rotary_emb" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"{folder}: the weights do not match a {arch} of config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.model.rotary_emb = RotaryEmbedding(cfg).to(device)
    return model.to(dtype).eval().requires_grad_(False)


class RewardModelVerifier:
    """``verifier: reward_model``; options ``path`` (the folder: config.json, safetensors,
    tokenizer.json), ``max_length`` (tokens a scored text may have; default the model's
    ``max_position_embeddings``: a longer one raises, and that sample is skipped, named),
    ``batch_size`` (texts per forward, 16)."""

    def __init__(self, path: str, max_length: int | None = None, batch_size: int = 16):
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"task.kwargs.verifier_kwargs.path: {folder} holds no config.json (a reward model "
                             "folder: config.json, *.safetensors, tokenizer.json)")
        d = json.loads((folder / "config.json").read_text())
        arch = (d.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:  # said when the config loads, not at the first score
            raise ValueError(f"task.kwargs.verifier_kwargs.path: {folder / 'config.json'}: architecture {arch!r} "
                             f"is not a reward model this project runs ({sorted(ARCHITECTURES)})")
        for key, value in (("max_length", max_length), ("batch_size", batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"task.kwargs.verifier_kwargs.{key}: an integer >= 1, got {value!r}")
        self.folder, self.batch_size = folder, batch_size
        self.max_length = max_length or int(d.get("max_position_embeddings") or 32768)
        self._model: SequenceScorer | None = None
        self._tok = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                from workers.tokenizer import Tokenizer

                self._tok = Tokenizer.load(self.folder)
                self._model = load_scorer(self.folder)
        return self._model, self._tok

    def text(self, prompt: TaskPrompt, completion: str) -> str:
        _, tok = self._load()
        if tok.chat_template:
            chat = list(prompt.messages) or [{"role": "user", "content": prompt.prompt}]
            return tok.apply_chat_template(chat + [{"role": "assistant", "content": completion}],
                                           add_generation_prompt=False)
        return prompt.prompt + completion

    def batch(self, prompts: list[TaskPrompt], completions: list[str]) -> list[float]:
        model, tok = self._load()
        ids = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            text = self.text(p, c)
            seq = tok.encode(text, add_special_tokens=not tok.chat_template)
            if not seq:
                raise ValueError(f"sample {i} of the batch: an empty text to score")
            if len(seq) > self.max_length:
                raise ValueError(f"sample {i} of the batch: {len(seq)} tokens, over the reward model's max_length "
                                 f"{self.max_length} (task.kwargs.verifier_kwargs.max_length)")
            ids.append(torch.tensor(seq, dtype=torch.long))
        device = next(model.parameters()).device
        out: list[float] = []
        with torch.no_grad():
            for start in range(0, len(ids), self.batch_size):
                chunk = [s.to(device) for s in ids[start:start + self.batch_size]]
                out += model(chunk)[:, 0].tolist()
        return out

    def __call__(self, prompt: TaskPrompt, completion: str) -> float:
        return self.batch([prompt], [completion])[0]
