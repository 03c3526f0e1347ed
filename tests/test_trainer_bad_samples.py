"""Bad samples, as docs/trainer.md ("Bad input") promises them, on the real TrainerWorker.

Each kind of bad sample is skipped with a warning naming it and counted in
``skipped_samples`` (``on_bad_sample: skip``), or refused with a ``ValueError`` naming it
(``error``); a skipped sample still counts towards its group's completion. The good samples of
the same step train exactly as if the bad one had never been sent: the weights equal those of
a trainer that only received the good samples. Caller bugs (unknown sample id or group) raise
in both modes; incomplete groups train on what arrived (``incomplete_groups``); a micro-batch
with a non-finite loss is skipped (``skipped_microbatches``) and the others still train.
"""
import logging
import re
from dataclasses import replace

import pytest
import torch

from workers.model import ModelConfig, load_pretrained
from workers.tasks import make_task
from workers.tokenizer import Tokenizer
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.rollout import rollout

torch.set_num_threads(1)
TINY = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
GROUPS, N = 4, 3  # group g holds samples g*N .. g*N+N-1
# adam_eps=1 keeps the update ~linear in the gradient (see tests/test_trainer.py), entropy_coef
# gives a gradient even where a group's advantages are all zero
GRPO = dict(algorithm="grpo", lr=1e-2, adam_eps=1.0, kl_coef=0.05, entropy_coef=0.01)
PPO = dict(algorithm="ppo", lr=1e-2, adam_eps=1.0, kl_coef=0.02, kl_mode="reward")


class ScoreTask:
    """A dense deterministic reward on any completion (a random tiny model scores 0 on the real
    task). The verifier raises on completions in ``raise_on`` and scores ``huge`` on prompts in
    ``huge_on`` (finite, but the PPO value loss of such a sample overflows to inf)."""

    def __init__(self, base, raise_on=(), huge_on=()):
        self.base, self.raise_on, self.huge_on = base, set(raise_on), set(huge_on)

    def prompts(self, split):
        return self.base.prompts(split)

    def score(self, prompt, completion):
        if completion in self.raise_on:
            raise ValueError("verifier crashed on this completion")
        if prompt.prompt in self.huge_on:
            return 3e38
        return (len(completion) % 5) / 4


@pytest.fixture(scope="module")
def base():
    return make_task("synthetic", max_terms=3, num_train=64, num_test=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, base):
    folder, _ = build_model_dir(tmp_path_factory.mktemp("m") / "tiny", base, TINY, seed=0)
    return str(folder)


@pytest.fixture(scope="module")
def rollouts(model_dir, base):
    """(samples, prompts, group_sizes): GROUPS groups of N samples from the initial weights."""
    model = load_pretrained(model_dir, "cpu", dtype=torch.float32)
    tok = Tokenizer.load(model_dir)
    samples, prompts, groups = rollout(model, tok, base.prompts("train")[:GROUPS], N, 12, seed=0)
    assert [s.sample_id for s in samples] == list(range(GROUPS * N)) and groups == {g: N for g in range(GROUPS)}
    assert all(len(s.output_ids) > 1 for s in samples)
    return samples, prompts, groups


def weights(w):
    return {k: v.detach().clone() for k, v in w.named_weights()}


def assert_same_weights(a, b):
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-7, rtol=1e-6, msg=k)


def run(cfg, model_dir, task, prompts, groups, batches):
    """A fresh trainer, one iteration: receive each batch, step -> (result, weights before, after)."""
    w = TrainerWorker(TrainerConfig(**cfg), model_dir, task, device="cpu")
    before = weights(w)
    w.begin_iteration(0, prompts, groups)
    for b in batches:
        w.receive(b)
    res = w.step()
    return res, before, weights(w)


def trainer_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "streamrl.trainer" and r.levelno == logging.WARNING]


# ---- per-sample bad input ----------------------------------------------------------------------
def _generation_error(s, tok):
    return replace(s, output_ids=torch.zeros(0, dtype=torch.long), logprobs=torch.zeros(0), finish_reason="error",
                   error="kv cache exhausted"), f"sample {s.sample_id}: generation failed (kv cache exhausted)"


def _logprobs_short(s, tok):
    n = len(s.output_ids)
    return replace(s, logprobs=s.logprobs[:-1]), f"sample {s.sample_id}: logprobs of shape ({n - 1},) for {n} output tokens"


def _logprobs_2d(s, tok):  # the right count in another shape crashed the step's packing (review, s53)
    n = len(s.output_ids)
    return replace(s, logprobs=s.logprobs[:, None]), f"sample {s.sample_id}: logprobs of shape ({n}, 1) for {n} output tokens"


def _output_2d(s, tok):
    return replace(s, output_ids=s.output_ids[None]), (
        f"sample {s.sample_id}: prompt_ids and output_ids must be 1-D token ids, got shapes "
        f"({len(s.prompt_ids)},) and (1, {len(s.output_ids)})")


def _logprobs_nan(s, tok):
    lp = s.logprobs.clone()
    lp[1] = float("nan")
    return replace(s, logprobs=lp), f"sample {s.sample_id}: non-finite sampler logprobs"


def _logprobs_neg_inf(s, tok):
    lp = s.logprobs.clone()
    lp[0] = float("-inf")
    return replace(s, logprobs=lp), f"sample {s.sample_id}: non-finite sampler logprobs"


def _too_long(s, tok):  # past the model's positions: the engine refuses such prompts, a trainer too
    n = TINY.max_position_embeddings - len(s.prompt_ids) + 1
    out = torch.full((n,), 5, dtype=torch.long)
    return replace(s, output_ids=out, logprobs=torch.full((n,), -1.0)), (
        f"sample {s.sample_id}: {len(s.prompt_ids)} + {n} tokens exceed the model's max_position_embeddings "
        f"{TINY.max_position_embeddings}")


def _empty_prompt(s, tok):  # the engine refuses these; a sample from elsewhere must not be packed
    return replace(s, prompt_ids=torch.zeros(0, dtype=torch.long)), f"sample {s.sample_id}: empty prompt"


def _verifier_raises(s, tok):  # the sample itself is fine; ScoreTask raises on its completion
    return s, f"sample {s.sample_id}: the task's score raised ValueError('verifier crashed on this completion')"


BAD = {"generation_error": _generation_error, "logprobs_short": _logprobs_short, "logprobs_2d": _logprobs_2d,
       "output_2d": _output_2d, "logprobs_nan": _logprobs_nan,
       "logprobs_neg_inf": _logprobs_neg_inf, "too_long": _too_long, "verifier_raises": _verifier_raises,
       "empty_prompt": _empty_prompt}


def _pick_bad(samples, tok):
    """A sample of the last group whose completion no other sample shares (so a verifier keyed on
    the completion raises for it alone)."""
    texts = [tok.decode(s.output_ids) for s in samples]
    for s in samples[(GROUPS - 1) * N:]:
        if texts.count(texts[s.sample_id]) == 1:
            return s, texts[s.sample_id]
    raise AssertionError("no unique completion in the last group")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_sample_is_skipped_counted_and_the_rest_trained(model_dir, base, rollouts, caplog, kind, algo):
    samples, prompts, groups = rollouts
    tok = Tokenizer.load(model_dir)
    victim, text = _pick_bad(samples, tok)
    bad, reason = BAD[kind](victim, tok)
    task = ScoreTask(base, raise_on=[text] if kind == "verifier_raises" else [])
    cfg = GRPO if algo == "grpo" else PPO
    sent = [bad if s.sample_id == victim.sample_id else s for s in samples]
    good = [s for s in samples if s.sample_id != victim.sample_id]
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        res, before, after = run(cfg, model_dir, task, prompts, groups, [sent])
    msgs = trainer_warnings(caplog)
    skips = [m for m in msgs if " skips " in m]
    if kind == "verifier_raises":  # logged once per kind of failure, by the scorer, with the cause
        assert skips == []
        said = f"sample {victim.sample_id} (prompt {prompts[victim.sample_id].prompt[:80]!r}"  # which row: review, s57
        assert any(m.startswith(said) and "): the task's score raised ValueError('verifier crashed on this "
                   "completion'); skipped" in m for m in msgs), msgs
    else:
        assert skips == [f"trainer rank 0 skips {reason} (more samples skipped for this reason are counted, "
                         "not listed)"]
    m = res.metrics
    good_tokens = sum(len(s.output_ids) for s in good)
    assert m["skipped_samples"] == 1 and m["duplicates"] == 0 and m["skipped_microbatches"] == 0
    # the skipped sample completes its group: no group is left incomplete at step()
    assert m["incomplete_groups"] == 0
    assert res.num_samples == m["num_seqs"] == len(good) == GROUPS * N - 1
    assert res.num_tokens == good_tokens
    assert m["step_skipped"] == 0 and m["updates"] == 1 and res.version == 1
    scores = [task.score(prompts[s.sample_id], tok.decode(s.output_ids)) for s in good]
    assert m["reward_mean"] == pytest.approx(sum(scores) / len(scores), rel=1e-12)
    # the good samples trained exactly as if the bad one had never been sent
    ref, ref_before, ref_after = run(cfg, model_dir, task, prompts, groups, [good])
    assert any(not torch.equal(after[k], before[k]) for k in after)
    assert_same_weights(after, ref_after)
    assert ref.num_samples == res.num_samples and ref.num_tokens == res.num_tokens
    assert ref.metrics["skipped_samples"] == 0
    # without the skipped one counting towards completion, its group is incomplete at step()
    assert ref.metrics["incomplete_groups"] == (1 if algo == "grpo" else 0)
    for k in ("pg_loss", "kl", "entropy", "grad_norm"):
        assert m[k] == pytest.approx(ref.metrics[k], rel=1e-5, abs=1e-9), k
    # on_bad_sample: error refuses it with the same message, naming the sample
    strict = TrainerWorker(TrainerConfig(**cfg, on_bad_sample="error"), model_dir, task, device="cpu")
    strict.begin_iteration(0, prompts, groups)
    with pytest.raises(ValueError, match=f"^{re.escape(reason)}$"):
        strict.receive([bad])


def test_whole_group_bad_completes_the_group(model_dir, base, rollouts):
    """Every sample of a group skipped: the group completes empty, the other groups train."""
    samples, prompts, groups = rollouts
    tok = Tokenizer.load(model_dir)
    last = range((GROUPS - 1) * N, GROUPS * N)
    sent = [_generation_error(s, tok)[0] if s.sample_id in last else s for s in samples]
    good = [s for s in samples if s.sample_id not in last]
    task = ScoreTask(base)
    res, before, after = run(GRPO, model_dir, task, prompts, groups, [sent])
    m = res.metrics
    assert m["skipped_samples"] == N and m["incomplete_groups"] == 0 and m["step_skipped"] == 0
    assert res.num_samples == (GROUPS - 1) * N and res.num_tokens == sum(len(s.output_ids) for s in good)
    ref, _, ref_after = run(GRPO, model_dir, task, prompts, {g: N for g in range(GROUPS - 1)}, [good])
    assert ref.metrics["incomplete_groups"] == 0
    assert any(not torch.equal(after[k], before[k]) for k in after)
    assert_same_weights(after, ref_after)


# ---- caller bugs: raise whatever on_bad_sample says -------------------------------------------
@pytest.mark.parametrize("policy", ["skip", "error"])
def test_unknown_group_or_sample_raises_and_consumes_nothing(model_dir, base, rollouts, policy):
    samples, prompts, groups = rollouts
    task = ScoreTask(base)
    w = TrainerWorker(TrainerConfig(**GRPO, on_bad_sample=policy), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(samples[:-2])
    prev, last = samples[-2:]
    # a call that raises consumes none of its samples (a good one before the bad one included)
    with pytest.raises(ValueError, match=rf"^sample {last.sample_id}: group_id 99 has no size in begin_iteration"):
        w.receive([prev, replace(last, group_id=99)])
    with pytest.raises(KeyError, match=f"sample {GROUPS * N + 5}: no prompt registered"):
        w.receive([prev, replace(last, sample_id=GROUPS * N + 5)])
    with pytest.raises(ValueError, match=rf"^sample {last.sample_id}: weight_version 3 is newer than the trainer's 0"):
        w.receive([prev, replace(last, weight_version=3)])
    w.receive([prev, last])  # sent again: trained, not dropped as duplicates
    res = w.step()
    m = res.metrics
    assert res.num_samples == GROUPS * N and res.version == 1
    assert m["skipped_samples"] == m["duplicates"] == m["incomplete_groups"] == 0


def test_ppo_needs_no_group(model_dir, base, rollouts):
    """Only GRPO/RLOO need groups: PPO takes a sample whose group has no size."""
    samples, prompts, _ = rollouts
    w = TrainerWorker(TrainerConfig(**PPO), model_dir, ScoreTask(base), device="cpu")
    w.begin_iteration(0, prompts, {})
    w.receive([replace(s, group_id=-1) for s in samples[:2]] + [replace(samples[2], group_id=99)])
    res = w.step()
    assert res.num_samples == 3 and res.metrics["incomplete_groups"] == 0 and res.version == 1


# ---- incomplete groups at step() --------------------------------------------------------------
def test_incomplete_groups_train_on_what_arrived(model_dir, base, rollouts, caplog):
    """Group 0 complete; group 1: 2 of 3 arrive; group 2: 1 good + 1 skipped of 3; group 3:
    nothing arrives. At step() groups 1 and 2 are incomplete and train with advantages over the
    samples they received (== the same samples as complete groups of those sizes); group 3 is
    not counted."""
    samples, prompts, groups = rollouts
    tok = Tokenizer.load(model_dir)
    task = ScoreTask(base)
    by_group = [samples[g * N:(g + 1) * N] for g in range(GROUPS)]
    good = by_group[0] + by_group[1][:2] + by_group[2][:1]
    bad = _generation_error(by_group[2][1], tok)[0]
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        res, before, after = run(GRPO, model_dir, task, prompts, groups, [good[:4], [bad], good[4:]])
    msgs = trainer_warnings(caplog)
    assert "trainer rank 0: group 1 has 2 of 3 samples at step(); using those" in msgs
    assert "trainer rank 0: group 2 has 2 of 3 samples at step(); using those" in msgs
    assert not any("group 0 has" in x or "group 3 has" in x for x in msgs)
    m = res.metrics
    assert m["incomplete_groups"] == 2 and m["skipped_samples"] == 1 and m["step_skipped"] == 0
    assert res.num_samples == m["num_seqs"] == 6 and res.num_tokens == sum(len(s.output_ids) for s in good)
    ref, _, ref_after = run(GRPO, model_dir, task, prompts, {0: 3, 1: 2, 2: 1}, [good])
    assert ref.metrics["incomplete_groups"] == 0 and ref.num_samples == 6
    assert any(not torch.equal(after[k], before[k]) for k in after)
    assert_same_weights(after, ref_after)
    # a group whose only arrival was skipped is incomplete too; the next iteration starts clean
    w = TrainerWorker(TrainerConfig(**GRPO), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(by_group[0] + [_generation_error(by_group[1][0], tok)[0]])
    r = w.step()
    assert r.metrics["incomplete_groups"] == 1 and r.metrics["skipped_samples"] == 1 and r.num_samples == N
    w.begin_iteration(1, prompts, groups)
    w.receive(samples)
    r = w.step()
    assert r.metrics["incomplete_groups"] == r.metrics["skipped_samples"] == 0 and r.num_samples == GROUPS * N


# ---- non-finite loss: the micro-batch is skipped ---------------------------------------------
def test_nonfinite_loss_skips_only_its_microbatch(model_dir, base, rollouts, caplog):
    """PPO, one sample per micro-batch: group 0's prompt scores 3e38 (finite), so its samples'
    value loss overflows to inf and their micro-batches are skipped before backward; the other
    micro-batches train exactly as if only they had been sent."""
    samples, prompts, groups = rollouts
    task = ScoreTask(base, huge_on=[prompts[0].prompt])
    huge = [s for s in samples if prompts[s.sample_id].prompt == prompts[0].prompt]
    assert [s.sample_id for s in huge] == list(range(N))  # the synthetic prompts are distinct
    good = samples[N:]
    cfg = dict(PPO, max_tokens_per_microbatch=1, whiten_advantages=False)  # 3e38 rewards would enter the whitening
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        res, before, after = run(cfg, model_dir, task, prompts, groups, [samples])
    msgs = trainer_warnings(caplog)
    assert [x for x in msgs if "non-finite loss" in x] == [
        f"trainer rank 0: non-finite loss in a micro-batch of samples [{s.sample_id}]; skipped" for s in huge]
    m = res.metrics
    assert m["skipped_microbatches"] == N and m["skipped_samples"] == 0 and m["step_skipped"] == 0
    # their samples were accepted and scored (num_samples) but not trained (num_seqs, num_tokens)
    assert res.num_samples == GROUPS * N and m["num_seqs"] == len(good)
    assert res.num_tokens == sum(len(s.output_ids) for s in good) and res.version == 1
    ref, _, ref_after = run(cfg, model_dir, task, prompts, groups, [good])
    assert ref.metrics["skipped_microbatches"] == 0 and ref.num_tokens == res.num_tokens
    assert any(not torch.equal(after[k], before[k]) for k in after)
    assert_same_weights(after, ref_after)
    for k in ("pg_loss", "value_loss", "grad_norm", "critic_grad_norm"):
        assert m[k] == pytest.approx(ref.metrics[k], rel=1e-5, abs=1e-9), k


def test_many_samples_skipped_for_one_reason_are_one_line_and_a_count(model_dir, base, rollouts, caplog):
    # a diverged policy gives every sample non-finite log-probs: 128 warning lines before
    samples, prompts, groups = rollouts
    bad = [replace(s, logprobs=torch.full_like(s.logprobs, float("nan"))) for s in samples[:5]]
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        res, _, _ = run(GRPO, model_dir, ScoreTask(base), prompts, groups, [bad + samples[5:]])
    msgs = trainer_warnings(caplog)
    assert len([m for m in msgs if " skips " in m]) == 1
    assert "trainer rank 0, iteration 0: skipped 5 x non-finite sampler logprobs" in msgs
    assert res.metrics["skipped_samples"] == 5


def test_the_skip_summary_keeps_a_rewards_own_numbers(model_dir, base, rollouts, caplog):
    # the reason was matched with its "sample N: " prefix, so a reward's own message had its
    # numbers turned to N ("ran past trainer.reward_timeout_s (N s)"); StreamRL's own reasons are
    # still counted as one kind whatever their numbers
    class Raises(ScoreTask):
        def score(self, prompt, completion):
            raise TypeError("compute_score() takes 2 positional arguments but 3 were given")

    samples, prompts, groups = rollouts
    w = TrainerWorker(TrainerConfig(), model_dir, Raises(base), device="cpu")
    w.begin_iteration(0, prompts, groups)
    with caplog.at_level(logging.WARNING, logger="streamrl.trainer"):
        w.receive(samples)
        w.step()
    summary = [r.getMessage() for r in caplog.records if "iteration 0: skipped" in r.getMessage()]
    assert len(summary) == 1
    said = "the task's score raised TypeError('compute_score() takes 2 positional arguments but 3 were given')"
    assert f"{GROUPS * N} x {said}" in summary[0]
