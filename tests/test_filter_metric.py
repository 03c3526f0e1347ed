"""``trainer.filter_metric`` (verl's ``algorithm.filter_groups.metric``): what DAPO's group filter
compares: the task's score, ``seq_reward`` (plus the overlong penalty), ``seq_final_reward`` (less
the KL penalty in the reward too), or a number of a dict reward (``acc``). The step's filter and
the refill's count (``TrainerWorker.passing_groups``) read the same numbers. Samples are built by
hand (``tests/test_trainer_stats``); rewards run in the trainer's real reward pool."""
from dataclasses import replace

import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.group_filter import metric_value
from tests.test_trainer_stats import build, model_dir  # noqa: F401

torch.set_num_threads(1)

# group id -> (score, response length, acc) of each sample
GROUPS = [
    [(1.0, 2, 1.0), (1.0, 8, 1.0)],  # same score, one overlong: differ in seq_reward only
    [(0.0, 3, 1.0), (1.0, 3, 1.0)],  # scores differ, acc the same (a partial-credit score)
    [(0.5, 2, 0.0), (0.5, 3, 1.0)],  # scores the same, acc differs
    [(0.0, 4, 0.0), (1.0, 2, 1.0)],  # both differ
]
LONG = dict(overlong_buffer=4, max_response_tokens=8, overlong_penalty=1.0)  # length 8: -1.0


class DictRewardTask:
    """verl's dict reward: ``{"score": ..., "acc": ...}`` from the prompt's meta."""

    def prompts(self, split):
        return []

    def score(self, prompt, completion):
        return {"score": prompt.meta["reward"], "acc": prompt.meta["acc"], "pred": None}


def _data(model_dir):  # noqa: F811
    samples, prompts, sizes = build(model_dir, [[(s, n) for s, n, _ in g] for g in GROUPS])
    for s in samples:
        prompts[s.sample_id].meta["acc"] = GROUPS[s.group_id][[x.sample_id for x in samples
                                                               if x.group_id == s.group_id].index(s.sample_id)][2]
    return samples, prompts, sizes


def _trained_groups(model_dir, samples, prompts, sizes, **cfg):  # noqa: F811
    w = TrainerWorker(TrainerConfig(algorithm="ppo", filter_groups=True, **cfg), model_dir, DictRewardTask(),
                      device="cpu")
    # the refill's count, from the rewards in flight as a trainer rank holds them
    pending = w.score_ahead(samples, prompts, 0)
    counted = w.passing_groups({g: [(s.sample_id, pending[s.sample_id], int(s.output_ids.numel()))
                                    for s in samples if s.group_id == g] for g in sizes})
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    m = w.step().metrics
    trained = sorted({s.group_id for s in samples} - {s.group_id for s in samples if s.sample_id in w.filtered_ids})
    assert m["num_seqs"] == 2 * len(trained) and m["filtered_groups"] == len(sizes) - len(trained)
    return trained, counted


@pytest.mark.parametrize("metric, kept", [("score", [1, 3]), ("seq_reward", [0, 1, 3]), ("acc", [2, 3]),
                                          ("seq_final_reward", [0, 1, 3])])  # (no KL in the reward)
def test_the_filter_compares_the_metric_and_the_refill_counts_the_same(model_dir, metric, kept):  # noqa: F811
    trained, counted = _trained_groups(model_dir, *_data(model_dir), filter_metric=metric, **LONG)
    assert trained == kept and counted == len(kept)


def test_seq_final_reward_takes_the_kl_penalty_in_the_reward(model_dir):  # noqa: F811
    """Group 0's second sample has other sampler log-probs than the reference's: its KL penalty
    makes its final reward differ from its sibling's, whose score and length it shares."""
    samples, prompts, sizes = build(model_dir, [[(1.0, 3), (1.0, 3)], [(0.0, 3), (0.0, 3)]])
    samples[1] = replace(samples[1], logprobs=samples[1].logprobs - 0.5)
    for p in prompts.values():
        p.meta["acc"] = 0.0
    kl = dict(kl_coef=0.1, kl_mode="reward")
    assert _trained_groups(model_dir, samples, prompts, sizes, filter_metric="seq_final_reward", **kl)[0] == [0]
    assert _trained_groups(model_dir, samples, prompts, sizes, filter_metric="seq_reward", **kl)[0] == []


def test_a_reward_without_the_named_number_is_an_error_naming_it(model_dir):  # noqa: F811
    samples, prompts, sizes = _data(model_dir)
    with pytest.raises(ValueError, match=r"trainer.filter_metric 'accuracy': sample 0's reward gave no number "
                                         r"'accuracy' \(its reward's keys: acc, pred, score\)"):
        _trained_groups(model_dir, samples, prompts, sizes, filter_metric="accuracy")
    with pytest.raises(ValueError, match="sample 3's reward gave no number 'pred'"):  # a text is no number
        metric_value("pred", 1.0, 0.0, {"pred": "42", "score": 1.0}, None, "sample 3")
    with pytest.raises(ValueError, match="its reward's keys: none: it returned a number, not a dict"):
        metric_value("correct", 1.0, 0.0, {}, None, "sample 0")
    # a number reward's acc is its score, as verl's DAPO reward manager records it (docs audit, s53)
    assert metric_value("acc", 0.5, -0.5, {}, None, "sample 0") == 0.5
    assert metric_value("seq_final_reward", 1.0, -0.5, {}, 0.25, "") == 0.25
    assert metric_value("seq_final_reward", 1.0, -0.5, {}, None, "") == 0.5  # before the reference ran


def test_config():
    assert from_dict({"trainer": {"filter_groups": True, "filter_metric": "acc"}}).trainer.filter_metric == "acc"
    with pytest.raises(ConfigError, match=r"trainer.filter_metric \('acc'\) is only used with trainer.filter_groups"):
        from_dict({"trainer": {"filter_metric": "acc"}})
    with pytest.raises(ConfigError, match="trainer.filter_metric must be a name"):
        from_dict({"trainer": {"filter_groups": True, "filter_metric": ""}})
    with pytest.raises(ConfigError, match="seq_final_reward with trainer.kl_mode: reward and trainer.train_groups"):
        from_dict({"trainer": {"filter_groups": True, "filter_metric": "seq_final_reward", "train_groups": 4,
                               "kl_coef": 0.1, "kl_mode": "reward"}})
    assert from_dict({"trainer": {"filter_groups": True, "filter_metric": "seq_final_reward",
                                  "kl_coef": 0.1, "kl_mode": "reward"}})  # no refill: the step's filter has it
    with pytest.raises(ConfigError, match="verl's 'metric'"):
        from_dict({"trainer": {"filter_groups": True, "metric": "acc"}})
