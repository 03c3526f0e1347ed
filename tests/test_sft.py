"""The SFT warm start (workers/trainer/sft.py, model.init's step that teaches a fresh model the
task's format): what one-line mutations changed unnoticed (mutation review, session 57), as the
RL tests only see a model that learned something."""
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.trainer_helpers import tiny_config
from workers.model import load_pretrained
from workers.tasks import make_task
from workers.tokenizer import Tokenizer
from workers.trainer.bootstrap import build_model_dir, build_tokenizer
from workers.trainer.sft import demonstrations, sft_warmstart


def test_sft_demonstrations_end_with_eos():
    """The warm start is where a model.init model learns to stop: every demonstration's
    completion ends with the EOS id (decoding with skip_special_tokens hides its absence)."""
    task = make_task("synthetic", max_terms=3, num_train=8, num_test=2)
    tok = build_tokenizer(task, 300)
    demos = demonstrations(tok, task)
    assert len(demos) == 8
    assert all(len(c) > 1 and c[-1] == tok.eos_id for _, c in demos)


def test_each_sft_step_steps_on_its_own_batchs_gradient(tmp_path):
    """One demonstration (every batch the same) and lr 0 (the weights stay): every step's
    gradient is the same; a gradient kept from the step before would be summed in."""
    task = make_task("synthetic", max_terms=3, num_train=1, num_test=1)
    folder, _ = build_model_dir(tmp_path / "m", task, tiny_config(), seed=0)
    model, tok = load_pretrained(folder, "cpu", dtype=torch.float32), Tokenizer.load(folder, chat_template=False)
    seen = []

    def hook(opt, args, kwargs):
        seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None])

    handle = register_optimizer_step_pre_hook(hook)
    try:
        sft_warmstart(model, tok, task, steps=3, batch_size=2, lr=0.0, grad_clip=1e9)
    finally:
        handle.remove()
    assert len(seen) == 3 and seen[0]
    for later in seen[1:]:
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(seen[0], later))
