"""A trainer checkpoint's ``model/`` is the source model folder with new weights: it carries the
folder's tokenizer, chat template and generation files, so the exported model tokenizes, formats
chats and stops as the source did (only tokenizer.json and tokenizer_config.json were copied)."""
import json
import shutil

import pytest
import torch

from tests.trainer_helpers import synthetic_task, tiny_config, tiny_model_dir
from workers.model import stop_ids
from workers.tokenizer import Tokenizer
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import checkpoint as tckpt

torch.set_num_threads(1)

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A model folder laid out as transformers 5 saves one, plus the files a hub folder has."""
    folder = tmp_path_factory.mktemp("src") / "model"
    shutil.copytree(tiny_model_dir(tmp_path_factory, tiny_config()), folder)
    (folder / "chat_template.jinja").write_text(CHAT)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7], "temperature": 0.7,
                                                                "top_p": 0.8}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "README.md").write_text("a model card")
    # not carried: other weight formats, hidden files, other folders
    (folder / "pytorch_model.bin").write_bytes(b"old weights")
    (folder / ".gitattributes").write_text("*.bin filter=lfs")
    (folder / "original").mkdir()
    (folder / "original" / "consolidated.00.pth").write_bytes(b"raw weights")
    return folder


def test_checkpoint_model_carries_the_source_folder_files(source, tmp_path):
    w = TrainerWorker(TrainerConfig(), str(source), synthetic_task(), device="cpu")
    w.save_checkpoint(str(tmp_path / "ckpt"))
    model = tmp_path / "ckpt" / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json", "README.md", "additional_chat_templates/tool_use.jinja"):
        assert (model / name).read_bytes() == (source / name).read_bytes(), name
    for name in ("pytorch_model.bin", ".gitattributes", "original"):
        assert not (model / name).exists(), name
    assert json.loads((model / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    # the exported model behaves as the source: its chat template and its stop ids
    src_tok, out_tok = Tokenizer.load(source), Tokenizer.load(model)
    assert out_tok.chat_template == src_tok.chat_template == CHAT
    assert out_tok.format_prompt("sum 1 2") == src_tok.format_prompt("sum 1 2")
    assert stop_ids(model, out_tok.eos_id) == stop_ids(source, src_tok.eos_id) == [0, 7]
    assert not list(tmp_path.glob(".ckpt.tmp*"))  # written atomically: no temp dir left
    tckpt.check(tmp_path / "ckpt", source, "grpo", critic=False)


def test_checkpoint_of_a_folder_without_head_dim_resumes(source, tmp_path):
    """transformers' Qwen2.5 config.json has no head_dim; the checkpoint's config.json (written
    by to_hf) has it: check compared 0 with the number and refused the resume."""
    folder = tmp_path / "nohd"
    shutil.copytree(source, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("head_dim")
    (folder / "config.json").write_text(json.dumps(cfg))
    w = TrainerWorker(TrainerConfig(), str(folder), synthetic_task(), device="cpu")
    w.save_checkpoint(str(tmp_path / "ckpt"))
    head_dim = json.loads((tmp_path / "ckpt" / "model" / "config.json").read_text())["head_dim"]
    assert head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    tckpt.check(tmp_path / "ckpt", folder, "grpo", critic=False)
    saved = {k: v.clone() for k, v in w.actor.state_dict().items()}
    with torch.no_grad():
        for p in w.actor.parameters():
            p.add_(1.0)
    w.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, saved[k]) for k, v in w.actor.state_dict().items())
    # a model whose head_dim really differs is still refused, by name
    other = tmp_path / "otherhd"
    shutil.copytree(folder, other)
    (other / "config.json").write_text(json.dumps({**cfg, "head_dim": 2 * head_dim}))
    with pytest.raises(ValueError, match=f"dim_head {head_dim} \\(this run: {2 * head_dim}\\)"):
        tckpt.check(tmp_path / "ckpt", other, "grpo", critic=False)


def test_carried_files_list(source):
    names = sorted(p.name for p in tckpt.carried_files(source))
    assert names == ["README.md", "additional_chat_templates", "chat_template.jinja", "generation_config.json",
                     "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
