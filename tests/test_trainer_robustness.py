"""TrainerWorker on input it must not train on, and losses that must not move the weights:
stale samples, empty outputs, NaN rewards, duplicates, caller bugs, out-of-vocabulary ids,
probabilities sent as log-probs, more samples of a group than its size, an infinite loss and
non-finite gradients (the helpers and fixtures: test_trainer.py)."""
import logging

import pytest
import torch
from test_trainer import CharTask, make_samples, model_dir, task, weights  # noqa: F401  (model_dir, task: fixtures)

from workers.trainer import TrainerConfig, TrainerWorker
from workers.types import Sample


def test_staleness_is_refused(model_dir, task, caplog):
    w = TrainerWorker(TrainerConfig(max_staleness=1), model_dir, task, device="cpu")
    samples, prompts, groups = make_samples(model_dir, task, groups=2, n=2)
    for it in range(2):  # version 0 -> 2
        w.begin_iteration(it, prompts, groups)
        w.receive(samples)
        w.step()
    assert w.version == 2
    fresh, _, _ = make_samples(model_dir, task, groups=2, n=2, version=1)
    w.begin_iteration(2, prompts, groups)
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        w.receive(samples[:2] + fresh[2:])  # group 0 stale (v0), group 1 at v1
    assert "stale" in caplog.text
    res = w.step()
    assert res.metrics["skipped_samples"] == 2 and res.num_samples == 2 and res.version == 3
    strict = TrainerWorker(TrainerConfig(max_staleness=0, on_bad_sample="error"), model_dir, task, device="cpu")
    strict.begin_iteration(0, prompts, groups)
    strict.receive(samples[:2])
    strict.step()
    strict.begin_iteration(1, prompts, groups)
    with pytest.raises(ValueError, match="stale"):
        strict.receive(samples[2:])


def test_bad_input_is_skipped_or_refused(model_dir, task, caplog):
    samples, prompts, groups = make_samples(model_dir, task, groups=2, n=2)
    empty = Sample(sample_id=0, prompt_ids=samples[0].prompt_ids, output_ids=torch.zeros(0, dtype=torch.long),
                   logprobs=torch.zeros(0), weight_version=0, finish_reason="stop", group_id=samples[0].group_id)
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        w.receive([empty] + samples[1:])
    assert "empty output" in caplog.text
    w.receive(samples[1:2])  # a duplicate: dropped, not trained twice
    res = w.step()
    assert res.metrics["skipped_samples"] == 1 and res.metrics["duplicates"] == 1 and res.num_samples == 3
    # NaN reward -> skipped with a warning; every sample bad -> no step, weights kept
    nan_w = TrainerWorker(TrainerConfig(), model_dir, CharTask(task.base, float("nan")), device="cpu")
    before = weights(nan_w)
    nan_w.begin_iteration(0, prompts, groups)
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        nan_w.receive(samples)
    assert "the task's score is nan; skipped" in caplog.text and caplog.text.count("score is nan") == 1  # once
    res = nan_w.step()
    assert res.metrics["step_skipped"] == 1 and res.version == 0 and res.metrics["skipped_samples"] == 4
    assert all(torch.equal(before[k], v) for k, v in weights(nan_w).items())
    # errors that are bugs in the caller
    with pytest.raises(KeyError, match="sample 999"):
        w.begin_iteration(1, prompts, groups)
        w.receive([Sample(999, samples[0].prompt_ids, samples[0].output_ids, samples[0].logprobs, 0, "stop", 0)])
    future = Sample(0, samples[0].prompt_ids, samples[0].output_ids, samples[0].logprobs, 7, "stop", 0)
    with pytest.raises(ValueError, match="newer"):
        w.receive([future])
    w.receive(samples[:1])
    with pytest.raises(RuntimeError, match="call step"):
        w.begin_iteration(2, prompts, groups)


def _with(s: Sample, **kw) -> Sample:
    from dataclasses import replace
    return replace(s, **kw)


def test_out_of_vocabulary_ids_and_positive_logprobs_are_bad_samples(model_dir, task, caplog):
    """An id past the vocabulary used to raise a bare IndexError from the embedding after the
    whole call's samples were marked seen (resending them was then dropped as duplicates);
    probabilities sent as log-probs were trained on."""
    samples, prompts, groups = make_samples(model_dir, task, groups=2, n=2)
    far = samples[0].output_ids.clone()
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    vocab = w.actor.config.vocab_size
    far[0] = vocab
    bad = [_with(samples[0], output_ids=far), _with(samples[1], logprobs=samples[1].logprobs.exp())]
    w.begin_iteration(0, prompts, groups)
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        w.receive(bad + samples[2:])
    assert f"sample 0: a token id outside the model's vocabulary [0, {vocab})" in caplog.text
    assert "sample 1: sampler logprobs above 0" in caplog.text and "probabilities" in caplog.text
    res = w.step()
    assert res.metrics["skipped_samples"] == 2 and res.num_samples == 2
    strict = TrainerWorker(TrainerConfig(on_bad_sample="error"), model_dir, task, device="cpu")
    strict.begin_iteration(0, prompts, groups)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        strict.receive(bad[:1])


def test_more_samples_of_a_group_than_its_size_is_refused(model_dir, task):
    """The extra sample used to open a second group of that id that never completed."""
    samples, prompts, groups = make_samples(model_dir, task, groups=2, n=2)
    gid = samples[0].group_id
    extra = _with(samples[0], sample_id=max(prompts) + 1)
    prompts = {**prompts, extra.sample_id: prompts[samples[0].sample_id]}
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    with pytest.raises(ValueError, match=f"group {gid}: 3 distinct samples received in iteration 0, "
                                         f"but begin_iteration gave it size 2"):
        w.receive([extra])
    w.receive(samples[:1])  # a resent sample is still a duplicate, not an extra one
    res = w.step()
    assert res.num_samples == 4 and res.metrics["duplicates"] == 1 and res.metrics.get("incomplete_groups", 0) == 0


def test_infinite_loss_and_nonfinite_grads_never_corrupt(model_dir, task, caplog):
    samples, prompts, groups = make_samples(model_dir, task, groups=2, n=2)
    huge = TrainerWorker(TrainerConfig(algorithm="ppo"), model_dir, CharTask(task.base, 3e38), device="cpu")
    before = weights(huge)
    huge.begin_iteration(0, prompts, groups)
    with caplog.at_level(logging.WARNING, "streamrl.trainer"):
        huge.receive(samples)
        res = huge.step()
    assert "non-finite loss" in caplog.text
    assert res.metrics["step_skipped"] == 1 and res.version == 0
    assert all(torch.equal(before[k], v) for k, v in weights(huge).items())
    w = TrainerWorker(TrainerConfig(max_tokens_per_microbatch=16), model_dir, task, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)  # trains micro-batches at once (small token budget)
    next(w.actor.parameters()).grad[0, 0] = float("inf")  # a blown-up backward
    before = weights(w)
    res = w.step()
    assert res.metrics["step_skipped"] == 1 and w.version == 0
    assert all(torch.equal(before[k], v) for k, v in weights(w).items())
    w.begin_iteration(1, prompts, groups)  # and the worker keeps working
    w.receive(samples)
    assert w.step().version == 1
