"""Small-LM ranker: a decoder from ``workers/model.py`` (built tiny from scratch with an
in-process byte-level BPE, or any HF-format folder) with a regression head on log-length.

``fit`` = (1) next-token pretraining on the prompts (no labels; ``pretrain_epochs``, 1 by
default, a pretrained folder too: set 0 to keep its weights as they are), then (2) fine-tuning backbone + head on standardized log(1 + words)
with MSE plus a pairwise RankNet loss inside each batch (the paper's "SFT a small LLM").
Pooling: mean of the last hidden states over the prompt's tokens, concatenated with
log(#tokens) since long prompts are truncated (head 3/4 + tail 1/4 of ``max_tokens``).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ranker import progress
from ranker.base import LogLengthRanker, check_fields, check_range, config_kwargs, make_config
from ranker.data import as_prompts, check_lengths
from workers.config_schema import Range, SEEDS, ranged
from workers.model import CausalLM, ModelConfig, init_weights, load_pretrained, save_pretrained
from workers.tokenizer import Tokenizer, train_bpe


@dataclass(frozen=True)
class LmConfig:
    model_dir: str = ""          # HF folder with tokenizer; "" = tiny model built from scratch
    vocab_size: int = ranged(1024, Range(1))
    hidden: int = ranged(64, Range(1))
    layers: int = ranged(2, Range(1))
    heads: int = ranged(4, Range(1))
    kv_heads: int = ranged(2, Range(1))
    intermediate: int = ranged(192, Range(1))
    max_tokens: int = ranged(192, Range(8))
    pretrain_epochs: int = ranged(1, Range(0))     # next-token epochs (0 to skip)
    epochs: int = ranged(4, Range(0))              # regression fine-tuning epochs
    batch_size: int = ranged(32, Range(2))
    lr: float = ranged(3e-3, Range(0, open_lo=True))
    pairwise_weight: float = ranged(0.5, Range(0))
    update_steps: int = ranged(30, Range(0))
    replay: int = ranged(256, Range(0))            # fine-tuning rows kept and mixed into every online update
    threads: int = ranged(2, Range(1))
    seed: int = ranged(0, SEEDS)

    def __post_init__(self):
        check_fields(self, "lm")
        if self.model_dir:  # the architecture and tokenizer come from the folder (check_model_dir)
            return
        check_range("lm", "vocab_size", self.vocab_size >= 258, ">= 258 (256 bytes + 2 special tokens)",
                    self.vocab_size)
        check_range("lm", "kv_heads", self.heads % self.kv_heads == 0, f"a divisor of heads ({self.heads})",
                    self.kv_heads)
        check_range("lm", "hidden", self.hidden % (2 * self.heads) == 0,
                    f"a multiple of 2 x heads ({2 * self.heads}: each head's size must be even for RoPE)", self.hidden)

    def check_model_dir(self) -> None:
        """A ValueError when ``model_dir`` is set and is no model folder with its tokenizer: said
        when a ranker is built to fit (``ranker.build``, before a run's bootstrap generates) and
        when it fits; not when a saved one loads (its own LM is in its folder)."""
        if not self.model_dir:
            return
        d = Path(self.model_dir).expanduser()
        missing = [f for f in ("config.json", "tokenizer.json") if not (d / f).is_file()]
        if missing:
            raise ValueError(f"lm config key 'model_dir': {self.model_dir!r} has no {' and no '.join(missing)} "
                             "(an HF model folder with its tokenizer; '' builds a tiny one)")

    @classmethod
    def from_dict(cls, d: dict, name: str = "lm") -> "LmConfig":
        return make_config(cls, config_kwargs(cls, d, name), name, "lm")


class PaddedCausal:
    """Attention backend for ``B`` right-padded rows of ``S`` tokens packed as ``T = B * S``:
    causal attention inside each row (padding sits after the real tokens, so it never leaks
    into them)."""

    def __init__(self, b: int, s: int):
        self.b, self.s = b, s

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.view(self.b, self.s, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(self.b * self.s, out.shape[1], out.shape[3])  # [T, H, Dh]


class LengthLM(nn.Module):
    """``forward(ids [B, S], mask [B, S], ntok [B]) -> standardized log-length [B]``."""

    def __init__(self, lm: CausalLM):
        super().__init__()
        self.lm = lm
        self.head = nn.Linear(lm.config.hidden_size + 1, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        pos = torch.arange(s).repeat(b)
        return self.lm(ids.reshape(-1), pos, PaddedCausal(b, s)).view(b, s, -1)  # [B, S, D]

    def embed(self, ids, mask, ntok) -> torch.Tensor:
        h = self.hidden(ids)
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)  # [B, D]
        return torch.cat([pooled, torch.log1p(ntok)[:, None] / 5.0], dim=1)

    def forward(self, ids, mask, ntok) -> torch.Tensor:
        return self.head(self.embed(ids, mask, ntok))[:, 0]


def _ranknet(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean pairwise logistic loss over pairs with different targets. pred, y: [B]."""
    diff_p = pred[:, None] - pred[None, :]
    sign = torch.sign(y[:, None] - y[None, :])
    valid = sign != 0
    if not bool(valid.any()):
        return pred.sum() * 0
    return F.softplus(-sign * diff_p)[valid].mean()


class LmRanker(LogLengthRanker):
    kind = "lm"

    @property
    def fitted(self) -> bool:
        return self.net is not None

    @property
    def min_rows(self) -> int:
        return 2

    def __init__(self, cfg: LmConfig | None = None, **kw):
        self.cfg = cfg or LmConfig.from_dict(kw)
        self.tok: Tokenizer | None = None
        self.net: LengthLM | None = None
        self.mu, self.sd = 0.0, 1.0
        self.replay: tuple[list[str], list[float]] = ([], [])  # (prompts, log-lengths) for updates

    # --- tokens ------------------------------------------------------------------------
    def _encode(self, prompts: Sequence[str]) -> tuple[list[list[int]], np.ndarray]:
        m, out, ntok = self.cfg.max_tokens, [], []
        head = (3 * m) // 4
        encoded = self.tok.tok.encode_batch(list(prompts), add_special_tokens=False)
        for e in encoded:
            ids = e.ids or [self.tok.eos_id]
            ntok.append(len(ids))
            out.append(ids if len(ids) <= m else ids[:head] + ids[len(ids) - (m - head):])
        return out, np.asarray(ntok, dtype=np.float32)

    def _batch(self, seqs: list[list[int]], ntok: np.ndarray, idx: np.ndarray):
        s = max(len(seqs[i]) for i in idx)
        pad = self.tok.pad_id if self.tok.pad_id is not None else self.tok.eos_id
        ids = torch.full((len(idx), s), pad, dtype=torch.long)
        mask = torch.zeros(len(idx), s)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1.0
        return ids, mask, torch.from_numpy(ntok[idx])

    def _batches(self, seqs, rng: np.random.RandomState) -> list[np.ndarray]:
        """Length-bucketed shuffled batches (little padding)."""
        order = np.argsort([len(s) + rng.rand() for s in seqs], kind="stable")
        bs = self.cfg.batch_size
        chunks = [order[i:i + bs] for i in range(0, len(order), bs)]
        return [chunks[j] for j in rng.permutation(len(chunks))]

    # --- building ----------------------------------------------------------------------
    def _build(self, prompts: Sequence[str]) -> None:
        c = self.cfg
        torch.manual_seed(c.seed)
        c.check_model_dir()
        if c.model_dir:
            # a saved ranker's own LM (``save_files``: its length head beside it) keeps the
            # tokenizer it was trained with; read as transformers would (its config.json says
            # qwen2), numbers would split otherwise than its embeddings learned
            d = Path(c.model_dir)
            own = (d.parent / f"{d.name}_length_head.safetensors").exists()
            self.tok = Tokenizer.load(c.model_dir, as_transformers=not own)
            lm = load_pretrained(c.model_dir, device="cpu", dtype=torch.float32)
        else:
            self.tok = train_bpe(prompts, vocab_size=c.vocab_size, split="gpt2")  # numbers whole: sizes and counts
            mc = ModelConfig(vocab_size=self.tok.vocab_size, hidden_size=c.hidden, intermediate_size=c.intermediate,
                             num_hidden_layers=c.layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                             max_position_embeddings=max(512, c.max_tokens), tie_word_embeddings=True,
                             eos_token_id=self.tok.eos_id)
            lm = init_weights(CausalLM(mc), seed=c.seed)
        self.net = LengthLM(lm)

    def _train(self, seqs, ntok, y: np.ndarray | None, steps_or_epochs: tuple[str, int], desc: str) -> None:
        """Next-token loss when ``y`` is None, else MSE + RankNet on standardized targets."""
        c, net = self.cfg, self.net
        rng = np.random.RandomState((c.seed + len(seqs)) % 2**32)
        unit, n = steps_or_epochs
        total = n if unit == "steps" else n * math.ceil(len(seqs) / c.batch_size)
        plan: list[np.ndarray] = []
        while len(plan) < total:
            plan.extend(self._batches(seqs, rng))
        plan = plan[:total]
        if not plan:
            return
        opt = torch.optim.AdamW(net.parameters(), lr=c.lr, weight_decay=0.01)
        warm, total = max(1, len(plan) // 10), len(plan)
        # Linear warm-up over 10% of the steps, then linear decay to 10% of the peak.
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: min((i + 1) / warm, 1.0 - 0.9 * max(0, i - warm) / max(1, total - warm)))
        yt = None if y is None else torch.from_numpy(((y - self.mu) / self.sd).astype(np.float32))
        net.train()
        with _threads(c.threads), progress.bar(desc, len(plan)) as bar:
            for idx in plan:
                ids, mask, nt = self._batch(seqs, ntok, idx)
                if yt is None:
                    logits = net.lm.logits(net.hidden(ids))[:, :-1]  # [B, S-1, V]
                    tgt = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
                else:
                    pred, target = net(ids, mask, nt), yt[idx]
                    loss = F.mse_loss(pred, target) + c.pairwise_weight * _ranknet(pred, target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                bar.advance(info=f"loss {loss.detach():.3f}")
        net.eval()

    # --- Ranker API ------------------------------------------------------------------------
    def pretrain(self, prompts: Sequence[str]) -> "LmRanker":
        """Tokenizer + model, then next-token epochs on the prompts (labels unused)."""
        prompts = as_prompts(prompts)
        self._build(prompts)
        if self.cfg.pretrain_epochs:
            seqs, ntok = self._encode(prompts)
            self._train(seqs, ntok, None, ("epochs", self.cfg.pretrain_epochs), "lm pretrain (next token)")
        return self

    def finetune(self, prompts: Sequence[str], lengths: Sequence[float]) -> "LmRanker":
        prompts = as_prompts(prompts)
        check_lengths(prompts, lengths)
        self._need_rows(len(prompts), "a spread of lengths to standardize")
        y = np.log1p(np.asarray(lengths, dtype=np.float64))
        self.mu, self.sd = float(y.mean()), float(max(y.std(), 1e-3))
        seqs, ntok = self._encode(prompts)
        self._train(seqs, ntok, y, ("epochs", self.cfg.epochs), "lm fine-tune (log-length)")
        keep = np.sort(np.random.RandomState(self.cfg.seed).permutation(len(prompts))[: self.cfg.replay])
        self.replay = ([prompts[i] for i in keep], [float(y[i]) for i in keep])
        self._refuse_diverged(prompts, "lr")
        return self

    def fit(self, prompts: Sequence[str], lengths: Sequence[float]) -> "LmRanker":
        prompts = as_prompts(prompts)
        check_lengths(prompts, lengths)
        self._need_rows(len(prompts), "a spread of lengths to standardize")
        return self.pretrain(prompts).finetune(prompts, lengths)

    def update(self, prompts: Sequence[str], lengths: Sequence[float]) -> "LmRanker":
        """A few fine-tuning steps on recent samples mixed with the replay rows kept from the
        fine-tuning set (normalisation kept): without them, 30 steps on two zero-length rows
        pulled every estimate towards zero (median 49 -> 0.4 words on unrelated prompts)."""
        self._need_fitted()
        prompts = as_prompts(prompts)
        check_lengths(prompts, lengths)
        if prompts and self.cfg.update_steps:
            rp, ry = self.replay
            seqs, ntok = self._encode(list(prompts) + rp)
            y = np.concatenate([np.log1p(np.asarray(lengths, dtype=np.float64)), np.asarray(ry, dtype=np.float64)])
            self._train(seqs, ntok, y, ("steps", self.cfg.update_steps), "lm update")
            self._refuse_diverged(prompts, "lr")
        return self

    @torch.no_grad()
    def _forward_all(self, prompts: Sequence[str], fn) -> np.ndarray:
        seqs, ntok = self._encode(prompts)
        order = np.argsort([len(s) for s in seqs], kind="stable")
        outs: dict[int, np.ndarray] = {}
        with _threads(self.cfg.threads):
            for i in range(0, len(order), 64):
                idx = order[i:i + 64]
                res = fn(*self._batch(seqs, ntok, idx)).numpy()
                outs.update({int(j): r for j, r in zip(idx, res)})
        return np.stack([outs[i] for i in range(len(prompts))])

    def predict_log(self, prompts: Sequence[str]) -> np.ndarray:
        """float64 [N] estimated log(1 + words)."""
        self._need_fitted()
        prompts = as_prompts(prompts)
        if not prompts:
            return np.zeros(0)
        return self._forward_all(prompts, self.net).astype(np.float64) * self.sd + self.mu

    def embed(self, prompts: Sequence[str]) -> np.ndarray:
        """float32 [N, hidden + 1]: pooled hidden state and scaled log(#tokens)."""
        self._need_fitted()
        prompts = list(prompts)
        if not prompts:
            return np.zeros((0, self.embed_dims), np.float32)
        return self._forward_all(prompts, self.net.embed).astype(np.float32)

    def frozen_copy(self) -> "LmRanker":
        """An independent copy (e.g. the label-free embedder the ensemble gives LightGBM)."""
        other = LmRanker(self.cfg)
        other.tok, other.net, other.mu, other.sd = self.tok, copy.deepcopy(self.net), self.mu, self.sd
        return other

    @property
    def embed_dims(self) -> int:
        return self.net.lm.config.hidden_size + 1

    # --- persistence -------------------------------------------------------------------------

    def meta(self) -> dict:
        return {"config": asdict(self.cfg), "fingerprint": self.fingerprint(), "mu": self.mu, "sd": self.sd}

    def fingerprint(self) -> str:
        import hashlib
        spec = {"lm_version": 1, "max_tokens": self.cfg.max_tokens, "pooling": "mean+logntok"}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]

    def save_files(self, folder: Path, sub: str = "lm") -> None:
        from safetensors.torch import save_file

        d = save_pretrained(self.net.lm, folder / sub)
        self.tok.save(d)
        # Beside the HF folder, not in it: the folder stays loadable by load_pretrained.
        save_file({k: v.contiguous() for k, v in self.net.head.state_dict().items()},
                  str(folder / f"{sub}_length_head.safetensors"))
        (folder / f"{sub}_replay.json").write_text(json.dumps({"prompts": self.replay[0],
                                                                "log_len": self.replay[1]}))

    @classmethod
    def load_files(cls, folder: Path, meta: dict, sub: str = "lm") -> "LmRanker":
        from safetensors.torch import load_file

        from ranker.features import FeatureMismatchError

        r = cls(LmConfig.from_dict(meta["config"]))
        if meta.get("fingerprint") != r.fingerprint():
            raise FeatureMismatchError(f"{folder}: LM ranker was trained with input encoding "
                                       f"{meta.get('fingerprint')!r}, this code uses {r.fingerprint()!r}; retrain")
        d = folder / sub
        r.tok = Tokenizer.load(d, as_transformers=False)  # the tokenizer it was trained with, as saved
        r.net = LengthLM(load_pretrained(d, device="cpu", dtype=torch.float32))
        r.net.head.load_state_dict(load_file(str(folder / f"{sub}_length_head.safetensors")))
        r.net.eval()
        r.mu, r.sd = float(meta["mu"]), float(meta["sd"])
        rp = folder / f"{sub}_replay.json"
        if rp.exists():  # folders saved before replay rows existed update without them
            d = json.loads(rp.read_text())
            r.replay = (list(d["prompts"]), [float(v) for v in d["log_len"]])
        return r


class _threads:
    """Temporarily set torch's intra-op threads."""

    def __init__(self, n: int):
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self):
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)
