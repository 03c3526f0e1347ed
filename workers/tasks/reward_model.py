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

import itertools
import json
import threading
from pathlib import Path

import torch
from torch import nn

from workers.model import Backbone, RotaryEmbedding, default_dtype, load_state, rank_device, resolve_device
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

    def forward(self, seqs: list[torch.Tensor], pad_id: int | None = None) -> torch.Tensor:
        """Token id sequences -> the logits [B, labels] (float32) at each one's rightmost token
        that is not ``pad_id`` (its last token when it has none), as transformers pools."""
        from workers.trainer.packing import attention_over

        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(len(s), device=ids.device) for s in seqs])
        cu = [0, *itertools.accumulate(len(s) for s in seqs)]
        # one packed T x T attention, or per sequence when cheaper (many texts: T^2 >> B * S^2)
        hidden = self.model(ids, pos, attention_over(cu, ids.device))
        picks = [start + _pooled(s, pad_id) for start, s in zip(cu, seqs)]
        return self.score(hidden[torch.tensor(picks, device=ids.device)]).float()


def _pooled(seq: torch.Tensor, pad_id: int | None) -> int:
    """The index transformers' ``...ForSequenceClassification`` reads: the rightmost non-pad token."""
    if pad_id is not None:
        keep = (seq != pad_id).nonzero()
        if len(keep):
            return int(keep[-1])
    return len(seq) - 1


def scorer_config(folder: Path) -> tuple[ModelConfig, int | None]:
    """The backbone's config and the pad id of a reward model folder; checks its architecture,
    its one label and its tensors' names and shapes (read from the headers, no weights loaded).
    Raises ValueError / FileNotFoundError naming the file."""
    from workers.model_check import check_weights

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
    check_weights(folder, cfg, build=lambda c: SequenceScorer(c, 1), what=f"a {arch} of config.json")
    pad = d.get("pad_token_id")
    return cfg, (int(pad) if isinstance(pad, int) and not isinstance(pad, bool) else None)


def load_scorer(folder: str | Path, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> SequenceScorer:
    folder = Path(folder)
    cfg, _ = scorer_config(folder)
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = SequenceScorer(cfg, 1).to(dtype)  # materialised in its dtype: no transient fp32 copy
    model = model.to_empty(device=device)
    model.load_state_dict({k: v for k, v in load_state(folder).items() if "rotary_emb" not in k}, strict=False)
    # after the dtype: RoPE's frequencies stay fp32 (transformers keeps inv_freq fp32 in a bf16 model)
    model.model.rotary_emb = RotaryEmbedding(cfg).to(device)
    return model.eval().requires_grad_(False)


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
        for key, value in (("max_length", max_length), ("batch_size", batch_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"task.kwargs.verifier_kwargs.{key}: an integer >= 1, got {value!r}")
        # said when the config loads, not at the first score (each sample would be skipped)
        from workers.tokenizer import Tokenizer

        try:
            cfg, self.pad_id = scorer_config(folder)
            self._tok = Tokenizer.load(folder)
        except (OSError, ValueError) as e:
            raise ValueError(f"task.kwargs.verifier_kwargs.path: {e}") from None
        self.folder, self.batch_size = folder, batch_size
        self.max_length = max_length or cfg.max_position_embeddings
        self._model: SequenceScorer | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # a task pickles (a reward process rebuilds it): not the model
        return {k: v for k, v in self.__dict__.items() if k not in ("_model", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _model=None, _lock=threading.Lock())

    def _load(self) -> SequenceScorer:
        with self._lock:
            if self._model is None:
                self._model = load_scorer(self.folder, rank_device())
        return self._model

    def text(self, prompt: TaskPrompt, completion: str) -> str:
        tok = self._tok
        if tok.chat_template:
            chat = list(prompt.messages) or [{"role": "user", "content": prompt.prompt}]
            return tok.apply_chat_template(chat + [{"role": "assistant", "content": completion}],
                                           add_generation_prompt=False)
        return prompt.prompt + completion

    def batch(self, prompts: list[TaskPrompt], completions: list[str]) -> list[float | ValueError]:
        """One score per sample; a sample that cannot be scored (an empty or over-long text) gets
        a ValueError in its place, which skips it alone (``scoring.safe_score_batch``)."""
        model, tok = self._load(), self._tok
        out: list[float | ValueError] = []
        ids: dict[int, torch.Tensor] = {}
        for i, (p, c) in enumerate(zip(prompts, completions)):
            seq = tok.encode(self.text(p, c), add_special_tokens=not tok.chat_template)
            if not seq:
                out.append(ValueError("an empty text to score"))
            elif len(seq) > self.max_length:
                out.append(ValueError(f"{len(seq)} tokens, over the reward model's max_length {self.max_length} "
                                      "(task.kwargs.verifier_kwargs.max_length)"))
            else:
                ids[i] = torch.tensor(seq, dtype=torch.long)
                out.append(0.0)
        device = next(model.parameters()).device
        todo = list(ids)
        with torch.no_grad():
            for start in range(0, len(todo), self.batch_size):
                part = todo[start:start + self.batch_size]
                for i, score in zip(part, model([ids[i].to(device) for i in part], self.pad_id)[:, 0].tolist()):
                    out[i] = score
        return out

    def __call__(self, prompt: TaskPrompt, completion: str) -> float:
        score = self.batch([prompt], [completion])[0]
        if isinstance(score, ValueError):
            raise score
        return score
