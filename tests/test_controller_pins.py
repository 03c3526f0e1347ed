"""Controller behaviour the rest of the suite let through when changed by one line (mutation
review, session 56): a lost trainer is not taken for a lost instance, a folder of torn
checkpoints is refused, a split of exactly one batch is one iteration an epoch, maj@k needs every
sample's pred (the epoch shuffle and the digest: tests/test_prompt_stream.py)."""
import pytest

from controller.rpc import WorkerFailed
from controller.sgs import SGS


def test_a_lost_trainer_is_raised_not_taken_for_a_lost_instance():
    sgs = SGS(dispatcher=None, received=lambda it: set())
    err = WorkerFailed(2, "trainer", "receive_weights", "EOF: end of file", lost=True)
    with pytest.raises(WorkerFailed):
        sgs.remove_lost(err, "weight push")


def test_a_folder_of_torn_checkpoints_is_refused_not_taken_for_an_empty_one(tmp_path):
    from controller.checkpoint import CheckpointError, find

    (tmp_path / "checkpoints" / "iter_000002" / "trainer").mkdir(parents=True)  # no controller.json, no latest
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find(tmp_path)


def test_a_split_of_exactly_one_batch_is_one_iteration_an_epoch():
    from controller.config import from_dict
    from controller.epochs import with_epochs

    run, _ = with_epochs(from_dict({"train": {"epochs": 3, "batch_prompts": 8}}), 8)
    assert run.train.iterations == 3


def test_no_majority_vote_when_a_sample_has_no_pred():
    from controller.val_metrics import prompt_stats

    got = prompt_stats([{"reward": 1.0, "pred": "4"}, {"reward": 0.0}, {"reward": 1.0, "pred": "4"}])
    assert not any(k.startswith("maj@") for k in got["reward"]), got["reward"]
