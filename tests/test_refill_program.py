"""The controller's refill (``trainer.max_gen_batches``, ``Program._refill``) on the real Program
and SGS with the stand-in instance and clock of ``tests/test_obs_program.py`` and a trainer
whose filter keeps half of the groups registered: every iteration generates two batches."""

import pytest

import controller.program as program_mod
from controller.data import PromptStream
from controller.rpc import WorkerHandle
from controller.trainer_rank import StepReport
from runtime_helpers import LocalRRef
from tests.test_obs_program import GEN_S, STEP_S, TRAIN, Clock, _program

BATCH = 2  # train.batch_prompts of tests.test_obs_program's config; group_size 2


class HalfKeptTrainer:
    """Records the prompts registered per iteration; its filter keeps half of the groups."""

    def __init__(self, clock):
        self.clock, self.version = clock, 0
        self.prompts: dict[int, dict] = {}
        self.groups: dict[int, dict] = {}

    def begin_iteration(self, iteration, prompts, groups, *mode):
        self.prompts[iteration], self.groups[iteration] = dict(prompts), dict(groups)
        return True

    def extend_iteration(self, iteration, prompts, groups):
        self.prompts[iteration].update(prompts)
        self.groups[iteration].update(groups)
        return True

    def kept_groups(self, iteration):
        return len(self.groups[iteration]) // 2

    def step(self, iteration):
        self.clock.t += STEP_S
        self.version += 1
        sids = sorted(self.prompts[iteration])
        return StepReport(2, iteration, self.version, {"reward_mean": 0.5, "num_samples": float(len(sids)),
                                                       "num_tokens": 3.0 * len(sids)},
                          len(sids), 3 * len(sids), 0, 0, lengths={s: 3 for s in sids}, per_instance={1: len(sids)})

    def items(self, iteration):
        """The iteration's prompts in prompt order (one per group)."""
        return [self.prompts[iteration][sid] for sid in sorted(self.prompts[iteration])][::2]


def _refill_program(monkeypatch, mode):
    clock = Clock()
    p = _program(monkeypatch, mode, clock)
    trainer = HalfKeptTrainer(clock)
    p.world.trainers = [WorkerHandle(2, "trainer", LocalRRef(trainer))]
    p.cfg.trainer.filter_groups, p.cfg.trainer.train_groups, p.cfg.trainer.max_gen_batches = True, BATCH, 10
    return p, trainer


@pytest.mark.parametrize("mode", ["stream", "async_stream", "async_batch"])
def test_a_checkpoint_resumes_the_prompt_stream_after_the_refills(monkeypatch, mode):
    """The prompt-stream state a checkpoint after iteration i saves (``stream_state_at(i + 1)``)
    draws iteration i+1's prompts, its refill's included: in the lag-1 modes the refill of i was
    drawn after the next batch's prompts, so a resumed run drew the refill's prompts again."""
    p, trainer = _refill_program(monkeypatch, mode)
    saved = {}
    p.on_iteration = lambda res: saved.setdefault(res.iteration + 1, p.stream_state_at(res.iteration + 1))
    res = p.run(4)
    assert [r.metrics["gen_batches"] for r in res] == [2.0] * 4
    drawn = [it for i in range(4) for it in trainer.items(i)]
    alone = PromptStream(TRAIN, 0)
    assert drawn == [it for _ in range(4 * 2) for it in alone.next(BATCH)]  # iteration after iteration, each whole
    for i in range(1, 4):
        again = PromptStream(TRAIN, 0, saved[i])
        assert again.next(BATCH) + again.next(BATCH) == trainer.items(i), i  # (a batch, then its refill)


@pytest.mark.parametrize("mode", ["stream", "async_stream", "async_batch"])
def test_generation_time_is_the_rounds_own(monkeypatch, mode):
    """``time/generation_s`` with a refill: its two rounds' generation, not the step and push the
    lag-1 modes wait for between them."""
    p, _ = _refill_program(monkeypatch, mode)
    res = p.run(3)
    assert [r.gen_seconds for r in res] == [2 * GEN_S] * 3
    assert all(r.num_samples == 2 * 2 * BATCH for r in res)


def test_the_sample_stride_bounds_only_the_batches_an_iteration_may_generate():
    """Without ``train_groups`` nothing refills: ``max_gen_batches``' default does not multiply
    the samples an iteration holds."""
    from controller.config import ConfigError, from_dict

    big = {"batch_prompts": 2000, "group_size": 100}  # 200k samples: 10 batches would pass the stride
    assert from_dict({"trainer": {"filter_groups": True}, "train": big}).trainer.max_gen_batches == 10
    with pytest.raises(ConfigError, match="must stay below 1000000 samples an iteration"):
        from_dict({"trainer": {"filter_groups": True, "train_groups": 8}, "train": big})
    assert program_mod.SAMPLE_STRIDE == 1_000_000
    # one batch past it, refills or not, would share ids with the next iteration
    with pytest.raises(ConfigError, match=r"^train.batch_prompts x train.group_size \(1000008 samples a batch\) must "
                                          "stay below 1000000 samples an iteration"):
        from_dict({"train": {"batch_prompts": 125001, "group_size": 8}})
