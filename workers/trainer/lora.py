"""LoRA adapters on the actor (``TrainerConfig.lora_rank``; verl's ``lora_rank`` / ``lora_alpha`` /
``target_modules``): the base weights are frozen, and each target linear layer's output gains
``scale * B(A(x))`` with ``A`` [r, in], ``B`` [out, r], ``scale = alpha / r``. Only A and B train.

The adapters live here, not in the model: a forward hook on each target ``nn.Linear`` adds the
delta, so the actor's own names, state dict and HF export stay the base model's. With the
adapters off (``disabled()``) the actor is the base model, which is the reference policy: a LoRA
trainer holds no second copy of the model. The engines get merged weights (``merged``: W +
scale * B A, same names and shapes), so generation and weight sync do not know about LoRA.

Saved as a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's
key names), which ``peft.PeftModel.from_pretrained`` and vLLM's LoRA loading read."""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# the decoder's linear layers, by the last part of their names (Qwen2 / Llama, as PEFT names them)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def target_names(spec: str | tuple[str, ...]) -> tuple[str, ...]:
    """``all-linear`` (verl's and PEFT's word for every linear layer but the head) or names from
    ``TARGETS``."""
    return TARGETS if spec == "all-linear" else tuple(dict.fromkeys(spec))  # (a name given twice: once)


def store_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Keep a frozen model's linear layers (not a head tied to the embedding) in ``dtype``.
    Under autocast to that dtype their matmuls cast the weights to it anyway, so the forward is
    the same, bit for bit, as the fp32 model's, at half the bytes for bf16; embeddings and norms
    stay fp32 (a model loaded whole in bf16 ran its residual stream in bf16: another model)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            tied = any(m.weight is e.weight for e in model.modules() if isinstance(e, nn.Embedding))
            if not tied:
                m.weight.data = m.weight.data.to(dtype)
                if m.bias is not None:
                    m.bias.data = m.bias.data.to(dtype)


class LoRA(nn.Module):
    def __init__(self, model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = TARGETS):
        super().__init__()
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.targets = targets
        self.enabled = True
        self.layers: dict[str, nn.Linear] = {n: m for n, m in model.named_modules()
                                             if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in targets}
        if not self.layers:
            raise ValueError(f"trainer.lora_target_modules {list(targets)}: no linear layer of the model has "
                             f"those names (its linear layers end in {list(TARGETS)})")
        self.lora_a, self.lora_b = nn.ParameterDict(), nn.ParameterDict()
        for name, lin in self.layers.items():
            key = name.replace(".", "__")  # a ParameterDict key holds no dot
            w = lin.weight
            a = torch.empty(rank, lin.in_features, device=w.device, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's default init: B = 0, so the delta starts at 0
            self.lora_a[key] = nn.Parameter(a)
            self.lora_b[key] = nn.Parameter(torch.zeros(lin.out_features, rank, device=w.device, dtype=torch.float32))
            lin.register_forward_hook(self._hook(key))
        model.requires_grad_(False)

    def _hook(self, key: str):
        def add_delta(_module, inputs, out):
            if not self.enabled:
                return out
            return out + self.scale * F.linear(F.linear(inputs[0], self.lora_a[key]), self.lora_b[key])
        return add_delta

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model for the duration (the reference policy). A flag of the module, not of
        the thread: every forward of the actor runs under the ``TrainerWorker``'s lock (what
        runs beside it, weight pushes, reads A and B and calls no forward)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def merged(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (the HF tensor ``name``) in fp32 with its layer's adapter folded in, if it
        has one (a base kept in bf16 is widened first: the sum is taken in fp32)."""
        weight = weight.float()
        module = name.removesuffix(".weight")
        if module not in self.layers or not name.endswith(".weight"):
            return weight
        key = module.replace(".", "__")
        with torch.no_grad():
            return weight + self.scale * (self.lora_b[key] @ self.lora_a[key])

    # ---- PEFT adapter folder -----------------------------------------------------------------
    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for name in self.layers:
            key = name.replace(".", "__")
            out[f"base_model.model.{name}.lora_A.weight"] = self.lora_a[key].detach().contiguous().cpu()
            out[f"base_model.model.{name}.lora_B.weight"] = self.lora_b[key].detach().contiguous().cpu()
        return out

    def save(self, folder: Path, base_model: str) -> None:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.peft_state_dict(), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / CONFIG_FILE).write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
            "target_modules": sorted({n.rsplit(".", 1)[-1] for n in self.layers}), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
            "inference_mode": True, "base_model_name_or_path": base_model}, indent=2))

    def load(self, folder: Path) -> None:
        """Adapters saved by ``save`` (``check_adapter`` has checked their settings and base):
        the layers must match (raises ValueError naming them)."""
        from safetensors.torch import load_file

        saved = load_file(str(folder / WEIGHTS_FILE))
        mine = self.peft_state_dict()
        if saved.keys() != mine.keys():
            extra, missing = sorted(saved.keys() - mine.keys()), sorted(mine.keys() - saved.keys())
            raise ValueError(f"{folder / WEIGHTS_FILE}: other layers than trainer.lora_target_modules "
                             f"(missing {missing[:3]}, not targeted here {extra[:3]})")
        with torch.no_grad():
            for name in self.layers:
                key = name.replace(".", "__")
                self.lora_a[key].copy_(saved[f"base_model.model.{name}.lora_A.weight"])
                self.lora_b[key].copy_(saved[f"base_model.model.{name}.lora_B.weight"])


def read_tensor(folder: Path, name: str) -> torch.Tensor:
    """One tensor of an HF model folder (single file or sharded with an index), read alone."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    file = folder / (json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors")
    with safe_open(str(file), "pt") as f:
        return f.get_tensor(name)


def tensor_names(folder: Path) -> set[str]:
    """The tensor names of an HF model folder (``read_tensor``'s files)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def check_adapter(adapter: Path, merged: Path, base: Path, rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    """Before a resume: the adapter folder has this run's rank, alpha and target layers, and was
    trained on ``base`` (this run's ``model.path``): every tensor of the checkpoint's merged model
    ``merged`` is ``base``'s, plus the adapters' product where they adapt it (to the rounding of
    the trainer's sum, or of a base it kept in bf16). Another base of the same shapes (anywhere:
    one adapted layer or a norm), or the checkpoint's own merged model as the base (the adapters
    would then count twice), is refused. It reads both models' shared tensors once. Raises
    ValueError naming the folders and the first tensor that differs."""
    from safetensors import safe_open

    conf = json.loads((adapter / CONFIG_FILE).read_text())
    saved = (conf.get("r"), float(conf.get("lora_alpha", -1)), sorted(set(conf.get("target_modules") or ())))
    mine = (rank, float(alpha), sorted(set(targets)))
    if saved != mine:
        raise ValueError(f"{adapter / CONFIG_FILE}: adapters of rank {saved[0]}, alpha {saved[1]:g} on {saved[2]}; "
                         f"this run's trainer.lora_rank {rank}, lora_alpha {alpha:g}, lora_target_modules {mine[2]}")
    pairs = {}  # tensor name -> (A, B): its update is alpha / rank * B @ A
    with safe_open(str(adapter / WEIGHTS_FILE), "pt") as f:
        for key in f.keys():
            if key.endswith(".lora_A.weight"):
                a, b = f.get_tensor(key).double(), f.get_tensor(key.replace(".lora_A.", ".lora_B.")).double()
                pairs[key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")] = (a, b)
    hint = ("resume with the model.path they were trained on (a checkpoint's model/ holds base and adapters "
            "merged: it is not their base)")
    for name in sorted(set(pairs) | (tensor_names(merged) & tensor_names(base))):
        w, got = read_tensor(base, name), read_tensor(merged, name)
        if w.shape != got.shape:
            raise ValueError(f"{adapter}: the adapters were not trained on this run's model.path {base}: {name} is "
                             f"{tuple(w.shape)} there, {tuple(got.shape)} in {merged}; {hint}")
        off, change, w_max = _merged_off(w, got, pairs.get(name), alpha / rank)
        # the sum's rounding (fp32 on the trainer, or its bf16 base) and the product's order: far
        # below the whole delta, which a wrong base or a merged one counted twice is off by
        if off > 1e-2 * change + 4 * float(torch.finfo(torch.float32).eps) * w_max:
            what = (f"is not that model's plus the adapters (off by {off:.3g}; the adapters change it by {change:.3g})"
                    if name in pairs else f"is not that model's (off by {off:.3g}; the adapters do not touch it)")
            raise ValueError(f"{adapter}: the adapters were not trained on this run's model.path {base}: {name} of "
                             f"{merged} {what}; {hint}")


def _merged_off(w: torch.Tensor, got: torch.Tensor, pair, scale: float,
                chunk: int = 1 << 22) -> tuple[float, float, float]:
    """(how far ``got`` is from ``w`` plus ``scale * B @ A`` (``pair``; None: nothing added),
    the base taken as is or rounded to bf16, whichever is nearer; the update's largest entry;
    ``w``'s largest entry), in float64 over ``chunk`` elements of rows at a time (a whole 7B
    embedding in float64, with its temporaries, was ~14 GB at once)."""
    w2, got2 = w.reshape(w.shape[0], -1) if w.dim() else w.reshape(1, 1), got.reshape(w.shape[0] if w.dim() else 1, -1)
    step = max(1, chunk // max(1, w2.shape[1]))
    exact = rounded = change = w_max = 0.0
    for i in range(0, w2.shape[0], step):
        wi, gi = w2[i:i + step].double(), got2[i:i + step].double()
        if pair is not None:
            a, b = pair
            delta = scale * (b[i:i + step] @ a)
            change = max(change, _amax(delta))
            gi -= delta
        exact = max(exact, _amax(gi - wi))
        rounded = max(rounded, _amax(gi - w2[i:i + step].bfloat16().double()))
        w_max = max(w_max, _amax(wi))
    return min(exact, rounded), change, w_max


class Reference(nn.Module):
    """The reference policy of a LoRA trainer: the actor with its adapters off (no grad)."""

    def __init__(self, actor: nn.Module, lora: LoRA):
        super().__init__()
        # in lists: not registered as submodules (the actor owns them; requires_grad_ here must not reach them)
        self._actor, self._lora = [actor], [lora]

    def forward(self, *args, **kwargs):
        with self._lora[0].disabled():
            return self._actor[0](*args, **kwargs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._actor[0].logits(hidden)  # the head is never adapted
