"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): a bf16 LoRA trainer's own checkpoint passes the pre-resume check when the adapter
delta is below bf16 rounding."""
from tests.test_trainer_lora import TARGETS, _cfg, _iterate, _task, setup  # noqa: F401
from workers.trainer import TrainerWorker


def test_the_resume_check_accepts_a_bf16_trainers_own_checkpoint(setup, tmp_path):  # noqa: F811
    """precision bf16 (a small step: an adapter delta far below the base's bf16 rounding) keeps the frozen base in bf16, so the checkpoint's merged model/ is
    bf16(W) + delta: the pre-resume check (checkpoint.check -> lora.check_adapter) must accept it
    on the run's own model.path (its bf16 rounding of the base is allowed for)."""
    from workers.trainer.checkpoint import check

    model_dir, data = setup
    w = TrainerWorker(_cfg(precision="bf16", lr=1e-4), model_dir, _task(), device="cpu")
    _iterate(w, data, 1)
    w.save_checkpoint(str(tmp_path / "ck"))
    check(tmp_path / "ck", model_dir, "grpo", False, 4, 8.0, TARGETS)  # raises ValueError if refused
