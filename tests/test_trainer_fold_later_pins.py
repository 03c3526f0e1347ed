"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): later PPO passes fold fractions with the token divisor and losses with the loss
divisor (seq_mean_token_sum)."""
import pytest

from tests.test_trainer_mini_batches import setup  # noqa: F401
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.rollout import rollout


def test_later_passes_fold_fractions_over_tokens_and_losses_over_sequences(setup, monkeypatch):  # noqa: F811
    """loss_agg seq_mean_token_sum, ppo_epochs 2: the fractions (ppo_kl, clipfrac, ratio) are
    averaged over every pass's tokens, the losses (pg_loss, entropy) over every pass's
    sequences, as the first pass's own metrics are (fraction_agg vs loss_divisor)."""
    model_dir, task = setup
    seen, real = [], TrainerWorker.accumulate

    def spy(self, items, log_stats, later=False):
        counts = real(self, items, log_stats, later)
        if counts is not None:
            seen.append({k: float(v) for k, v in counts.items() if v.numel() == 1})
        return counts

    monkeypatch.setattr(TrainerWorker, "accumulate", spy)
    w = TrainerWorker(TrainerConfig(algorithm="grpo", lr=5e-2, kl_coef=0.05, seed=0, max_tokens_per_microbatch=40,
                                    ppo_epochs=2, loss_agg="seq_mean_token_sum"), model_dir, task, device="cpu")
    samples, prompts, groups = rollout(w.actor, w.tokenizer, task.prompts("train")[:4], 3, 10, seed=5)
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    m = w.step().metrics
    tokens, seqs = sum(c["num_tokens"] for c in seen), sum(c["num_seqs"] for c in seen)
    assert tokens != seqs
    for key in ("ppo_kl", "clipfrac", "ratio"):
        assert m[key] == pytest.approx(sum(c[key] for c in seen) / tokens, rel=1e-9, abs=1e-12), key
    for key in ("pg_loss", "entropy", "kl"):
        assert m[key] == pytest.approx(sum(c[key] for c in seen) / seqs, rel=1e-9, abs=1e-12), key
