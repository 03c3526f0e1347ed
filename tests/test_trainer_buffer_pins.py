"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): the micro-batch budget's edges (exactly full pops, the tokens kept recounted) and a
new iteration refused while an incomplete group is held."""
import pytest
import torch

from tests.test_trainer_stats import KnownRewardTask, build, model_dir  # noqa: F401
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.buffer import Prepared, SampleBuffer, microbatches


def _p(sid, n_prompt, n_out):
    return Prepared(sample_id=sid, group_id=0, prompt_ids=torch.zeros(n_prompt, dtype=torch.long),
                    output_ids=torch.zeros(n_out, dtype=torch.long), old_logp=torch.zeros(n_out), ref_logp=None,
                    score=0.0, reward=0.0)


def test_a_micro_batch_takes_exactly_its_budget():
    """At most max_tokens packed tokens: samples that fill it exactly share one micro-batch, and
    a full budget is trainable without a flush."""
    items = [_p(0, 3, 2), _p(1, 2, 3), _p(2, 4, 6)]  # 5 + 5 + 10
    assert [[p.sample_id for p in mb] for mb in microbatches(items, 10)] == [[0, 1], [2]]
    buf = SampleBuffer()
    buf.push_ready(items[:2])
    assert [p.sample_id for p in buf.pop_microbatch(10, flush=False)] == [0, 1] and buf.ready_tokens == 0


def test_a_new_iteration_refuses_an_incomplete_group_still_held(model_dir):  # noqa: F811
    """begin_iteration before step() while a group waits for its other samples would drop
    (or mix into the next iteration) the samples already received: refused."""
    samples, prompts, sizes = build(model_dir, [[(1.0, 3), (0.0, 4)]])
    w = TrainerWorker(TrainerConfig(algorithm="grpo"), model_dir, KnownRewardTask(), device="cpu")
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples[:1])
    with pytest.raises(RuntimeError, match="1 pending samples"):
        w.begin_iteration(1, prompts, sizes)


def test_keep_ready_recounts_the_tokens_it_holds():
    """The group filter's keep_ready: the token count follows the subset, so a later non-flush
    pop waits for a full budget of what is really there."""
    items = [_p(0, 3, 2), _p(1, 2, 3), _p(2, 4, 6)]
    buf = SampleBuffer()
    buf.push_ready(items)
    buf.keep_ready(items[:1])
    assert buf.ready_tokens == 5 and buf.pop_microbatch(10, flush=False) == []
