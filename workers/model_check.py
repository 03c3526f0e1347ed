"""A Hugging Face model folder's weights checked against its config.json from the safetensors
headers alone (no tensor is read, so a 15 GB checkpoint is checked in milliseconds): every
file there and readable, every tensor the model needs present with its shape, nothing
unexpected. The controller runs it before any worker loads the folder, so a missing, truncated
or mismatched checkpoint is one line naming the file and the tensor, not a traceback from each
worker rank's ``load_state_dict``."""
from __future__ import annotations

import json
from pathlib import Path


def safetensors_files(folder: Path) -> list[str]:
    """The folder's weight files, as transformers' ``from_pretrained`` picks them:
    ``model.safetensors`` alone when it is there (other ``*.safetensors`` beside it, e.g.
    Mistral's ``consolidated.safetensors`` or an adapter, are not the model's, and it wins over
    an index too), else the index's shards (``model.safetensors.index.json``), else every
    ``*.safetensors``; FileNotFoundError when there are none."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map): "
                             f"{type(e).__name__}: {e}") from None
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


def header_shapes(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """tensor name -> (shape, file) from every weight file's header; a file missing, truncated
    or not safetensors is a ValueError / FileNotFoundError naming it."""
    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in safetensors_files(folder):
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: named by model.safetensors.index.json but not there")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = (tuple(f.get_slice(key).get_shape()), name)
        except Exception as e:  # noqa: BLE001 - safetensors' errors name no file: a truncated copy, a bad header
            raise ValueError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None
    return shapes


def check_weights(folder: str | Path, cfg=None, build=None, what: str = "config.json") -> None:
    """The folder's tensors against the model its config.json describes (``cfg``: that
    ModelConfig when the caller has read it already; the names and shapes ``load_pretrained``
    takes: rotary buffers ignored, ``lm_head`` optional when tied); a ValueError names the
    first few tensors missing, unexpected or of another shape. ``build``: the module the
    tensors are for, made from ``cfg`` (default ``CausalLM``; a reward model's scorer), ``what``
    said in the error."""
    import torch

    from workers.model import CausalLM
    from workers.model_config import ModelConfig

    folder = Path(folder)
    if cfg is None:
        cfg_path = folder / "config.json"
        cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()), cfg_path)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in (build or CausalLM)(cfg).state_dict().items() if "rotary_emb" not in k}
    got = {k: v for k, v in header_shapes(folder).items() if "rotary_emb" not in k}
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings and "lm_head.weight" in want else set()
    missing = [k for k in want if k not in got and k not in optional]
    unexpected = [k for k in got if k not in want]
    wrong = [f"{k} {list(got[k][0])} in {got[k][1]}, config.json gives {list(want[k])}"
             for k in want if k in got and got[k][0] != want[k]]
    problems = ([f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"] if missing else []) + \
               ([f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"] if unexpected else []) + \
               ([f"shapes: {'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}"] if wrong else [])
    if problems:
        raise ValueError(f"{folder}: the weights do not match {what}: {', '.join(problems)}")
