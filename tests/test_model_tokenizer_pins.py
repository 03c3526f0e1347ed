"""Model, tokenizer, checkpoint and SFT behaviour one-line mutations changed unnoticed (mutation
review, session 59): the SFT warm start's demonstrations, loss targets and LR schedule; a Qwen2
window just short of the context; a missing num_key_value_heads; a checkpoint of an untied model
into a tied model.path; special_tokens_map.json's additional special tokens; and a tied config
whose file holds another lm_head (transformers loads it untied: refused here); the SFT gradient clip."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.test_tokenizer_folder_checks import _folder, bpe  # noqa: F401 - the module's fixture
from tests.trainer_helpers import synthetic_task, tiny_config, tiny_model_dir
from workers.model import CausalLM, ModelConfig, init_weights, load_pretrained, load_state, save_pretrained
from workers.tasks import make_task
from workers.tokenizer import Tokenizer
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import checkpoint as tckpt
from workers.trainer.bootstrap import build_model_dir, build_tokenizer
from workers.trainer.sft import demonstrations, sft_warmstart

transformers = pytest.importorskip("transformers")


def test_a_tasks_own_demonstrations_are_what_sft_trains_on():
    """The synthetic task's noisy teacher (demo_noise 1: every demonstration truncated): the warm
    start trains on the task's demonstrations(), not on item.answer."""
    task = make_task("synthetic", max_terms=3, num_train=8, num_test=2, demo_noise=1.0)
    tok = build_tokenizer(task, 300)
    want = [tok.encode(text) + [tok.eos_id] for _, text in task.demonstrations("train")]
    answers = [tok.encode(item.answer) + [tok.eos_id] for item in task.prompts("train")]
    assert want != answers  # the case tells the two apart
    assert [c for _, c in demonstrations(tok, task)] == want


def test_the_sft_loss_is_the_mean_cross_entropy_of_the_completion_tokens_only(tmp_path):
    """One demonstration, lr 0: the first step's loss is the mean CE of predicting each completion
    token (and EOS) from what precedes it; no prompt token is a target."""
    torch.set_num_threads(1)
    task = make_task("synthetic", max_terms=3, num_train=1, num_test=1)
    folder, _ = build_model_dir(tmp_path / "m", task, tiny_config(), seed=0)
    model, tok = load_pretrained(folder, "cpu", dtype=torch.float32), Tokenizer.load(folder, chat_template=False)
    (p, c), = demonstrations(tok, task)
    with torch.no_grad():
        logits = model.forward_packed([torch.tensor(p + c)])
        ref = F.cross_entropy(logits[len(p) - 1:len(p) + len(c) - 1], torch.tensor(c)).item()
    res = sft_warmstart(model, tok, task, steps=1, batch_size=1, lr=0.0)
    assert abs(res.losses[0] - ref) < 1e-5


def test_the_sft_lr_warms_up_then_decays_by_cosine_to_a_tenth_over_the_steps(tmp_path):
    import math

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    torch.set_num_threads(1)
    task = make_task("synthetic", max_terms=3, num_train=2, num_test=1)
    folder, _ = build_model_dir(tmp_path / "m", task, tiny_config(), seed=0)
    model, tok = load_pretrained(folder, "cpu", dtype=torch.float32), Tokenizer.load(folder, chat_template=False)
    seen = []
    handle = register_optimizer_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
    try:
        sft_warmstart(model, tok, task, steps=6, batch_size=1, lr=1e-3, warmup=2)
    finally:
        handle.remove()
    want = [1e-3 * min(1.0, (s + 1) / 2) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / 6))) for s in range(6)]
    assert seen == [float(x) for x in want] or all(abs(a - b) < 1e-12 for a, b in zip(seen, want))
    assert len(seen) == 6


def test_a_qwen2_window_just_shorter_than_the_context_is_refused():
    """sliding_window one token short of max_position_embeddings, on every layer: transformers
    masks to the window, so loading it as full attention computes other logits past that length."""
    d = dict(architectures=["Qwen2ForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=4096,
             use_sliding_window=True, sliding_window=4095, max_window_layers=0)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(d)
    ModelConfig.from_hf({**d, "sliding_window": 4096})  # a window as long as the context changes nothing


def test_an_absent_num_key_value_heads_is_multi_head_attention_as_in_transformers():
    """A Llama config.json without num_key_value_heads (pre-GQA folders, e.g. Llama-1/2-7B era
    exports) is multi-head attention in transformers' LlamaConfig."""
    d = dict(architectures=["LlamaForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4)
    ours, hf = ModelConfig.from_hf(dict(d)), transformers.LlamaConfig.from_dict(dict(d))
    assert ours.num_key_value_heads == hf.num_key_value_heads == 4
    assert ours.dim_head == hf.head_dim == 16


def test_a_checkpoint_of_an_untied_model_is_refused_for_a_tied_model_path(tmp_path_factory, tmp_path):
    """Same shapes, other tie_word_embeddings: loading the untied checkpoint's lm_head.weight into a
    tied actor wrote it over the input embeddings (one shared tensor), silently."""
    torch.set_num_threads(1)
    task = synthetic_task()
    tied = tiny_model_dir(tmp_path_factory)  # tiny_config(): tie_word_embeddings=True
    untied = tiny_model_dir(tmp_path_factory, dataclasses.replace(tiny_config(), tie_word_embeddings=False))
    TrainerWorker(TrainerConfig(), untied, task, device="cpu").save_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(ValueError, match=r"another model than this run's model.path .*tie_word_embeddings False "
                                         r"\(this run: True\)"):
        tckpt.check(tmp_path / "ck", tied, "grpo", False)
    w = TrainerWorker(TrainerConfig(), tied, task, device="cpu")
    embed = w.actor.model.embed_tokens.weight.detach().clone()
    with pytest.raises(ValueError, match="another model"):
        w.load_checkpoint(str(tmp_path / "ck"))
    assert torch.equal(w.actor.model.embed_tokens.weight, embed)
    assert not torch.equal(embed, load_state(tmp_path / "ck" / "model")["lm_head.weight"])


def test_special_tokens_map_additional_special_tokens_are_one_id_as_in_transformers(tmp_path, bpe):  # noqa: F811
    """An older folder (no added_tokens_decoder in tokenizer_config.json) whose
    special_tokens_map.json lists ``<tool_call>`` under additional_special_tokens: transformers 5
    adds it as one special token; reading only tokenizer_config.json encoded its bytes."""
    path = _folder(tmp_path, bpe, files={"special_tokens_map.json": json.dumps(
        {"eos_token": "<|endoftext|>", "additional_special_tokens": ["<tool_call>"]})})
    assert "added_tokens_decoder" not in json.loads((path / "tokenizer_config.json").read_text())
    ours, theirs = Tokenizer.load(path), transformers.AutoTokenizer.from_pretrained(str(path))
    ids = theirs.encode("call <tool_call> now", add_special_tokens=False)
    assert len(ids) < len("call <tool_call> now")  # one id for <tool_call> in transformers
    assert ours.encode("call <tool_call> now") == ids


def test_a_tied_config_whose_file_holds_another_lm_head_is_refused(tmp_path):
    """config.json ties the embeddings but the file's lm_head.weight differs from the embeddings:
    transformers loads it untied (its lm_head), this model used the embeddings: logits ~25 apart.
    A head equal to the embeddings (some tied checkpoints carry both) still loads."""
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.1), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    load_pretrained(tmp_path, "cpu", dtype=torch.float32)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"ties the embeddings \(tie_word_embeddings true\) but the weights hold an "
                                         r"lm_head.weight other than model.embed_tokens.weight"):
        load_pretrained(tmp_path, "cpu", dtype=torch.float32)


def test_the_sft_gradients_are_clipped_to_grad_clip(tmp_path):
    """grad_clip bounds the update: at 1e-12 the clipped gradient is far below AdamW's eps, so a
    step barely moves the weights (without the clip, Adam's first step moves each by ~lr)."""
    torch.set_num_threads(1)
    task = make_task("synthetic", max_terms=3, num_train=2, num_test=1)
    folder, _ = build_model_dir(tmp_path / "m", task, tiny_config(), seed=0)
    tok = Tokenizer.load(folder, chat_template=False)
    moved = {}
    for clip in (1e-12, 1e9):
        model = load_pretrained(folder, "cpu", dtype=torch.float32)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        sft_warmstart(model, tok, task, steps=1, batch_size=1, lr=1e-2, warmup=1, grad_clip=clip)
        moved[clip] = max((v - before[k]).abs().max().item() for k, v in model.state_dict().items())
    assert moved[1e-12] < 1e-5 < 1e-3 < moved[1e9]


def test_the_bootstrap_seeds_its_weights_learns_system_turns_and_evaluates_without_sft(tmp_path):
    """model.init: the seed sets the weights (one seed ignored: every run the same start); the BPE
    learns the system turns' text (what the policy sees); eval_items evaluates also with no SFT."""
    from types import SimpleNamespace

    from workers.types import TaskPrompt

    torch.set_num_threads(1)
    task = make_task("synthetic", max_terms=3, num_train=8, num_test=4)
    a, again, b = (load_state(build_model_dir(tmp_path / name, task, tiny_config(), seed=s)[0])
                   for name, s in (("a", 0), ("again", 0), ("b", 1)))
    assert all(torch.equal(a[k], again[k]) for k in a) and not all(torch.equal(a[k], b[k]) for k in a)
    _, result = build_model_dir(tmp_path / "e", task, tiny_config(), eval_items=4)
    assert result.losses == [] and result.eval_reward is not None
    system = "Zyxwvut answers tersely."
    chat = SimpleNamespace(prompts=lambda split: [TaskPrompt(prompt=f"{i} + 1 =", answer=str(i + 1), task="t", messages=[
        {"role": "system", "content": system}, {"role": "user", "content": f"{i} + 1 ="}]) for i in range(50)])
    tok = build_tokenizer(chat, 300)
    assert len(tok.encode(system)) <= 4, tok.encode(system)  # learned: its words merged, not bytes
