"""A trainer checkpoint gives each data-parallel rank its own RNG state back, and a damaged one
is refused naming the file that is wrong (review, session 50)."""
import json
import shutil

import pytest
import torch

from workers.tasks import make_task
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.weight_sync.localrun import run_local
from tests.trainer_helpers import LengthRewardTask, tiny_config


def _task():
    return LengthRewardTask(make_task("synthetic", max_terms=3, num_train=16, num_test=4))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_model_dir(tmp_path_factory.mktemp("m") / "m", _task().base, tiny_config(), seed=0)[0])


def _save_draw_load(rank, world, model_dir, ckpt):
    torch.set_num_threads(1)
    w = TrainerWorker(TrainerConfig(), model_dir, _task(), rank=rank, world_size=world, device="cpu")
    torch.rand(10 + 7 * rank)  # the ranks' generators apart (clip_cov draws per token of its own samples)
    w.save_checkpoint(ckpt)
    torch.distributed.barrier()  # rank 0 has written it (the controller waits for every rank's save)
    at_save = torch.get_rng_state().clone()
    torch.rand(100)
    w.load_checkpoint(ckpt)
    return torch.equal(torch.get_rng_state(), at_save), at_save


def test_each_rank_resumes_with_its_own_rng_state(model_dir, tmp_path):
    """Only rank 0's state was saved and every rank loaded it: a clip_cov run on two ranks
    resumed with other draws on rank 1, and every weight differed from the uninterrupted run."""
    (own0, state0), (own1, state1) = run_local(2, _save_draw_load, model_dir, str(tmp_path / "ck"))
    assert own0 and own1 and not torch.equal(state0, state1)
    # one rank resuming the two ranks' checkpoint takes rank 0's (the ranks changed)
    w = TrainerWorker(TrainerConfig(), model_dir, _task(), device="cpu")
    w.load_checkpoint(str(tmp_path / "ck"))
    assert torch.equal(torch.get_rng_state(), state0)


@pytest.fixture()
def lora_ckpt(model_dir, tmp_path):
    cfg = TrainerConfig(lora_rank=4)
    TrainerWorker(cfg, model_dir, _task(), device="cpu").save_checkpoint(str(tmp_path / "ck"))
    return cfg, tmp_path / "ck"


def test_a_missing_trainer_json_is_named_not_taken_for_a_run_without_lora(model_dir, lora_ckpt):
    cfg, ck = lora_ckpt
    (ck / "trainer.json").unlink()
    with pytest.raises(ValueError, match=r"trainer.json: unreadable, the checkpoint is damaged \(missing\)"):
        TrainerWorker(cfg, model_dir, _task(), device="cpu").load_checkpoint(str(ck))


def test_a_missing_checksums_file_is_named(model_dir, lora_ckpt):
    """Deleting checksums.json turned every integrity check off."""
    cfg, ck = lora_ckpt
    assert json.loads((ck / "trainer.json").read_text())["checksums"] is True
    damaged = ck.parent / "damaged"
    shutil.copytree(ck, damaged)
    (damaged / "checksums.json").unlink()
    with pytest.raises(ValueError, match="checksums.json: unreadable, the checkpoint is damaged"):
        TrainerWorker(cfg, model_dir, _task(), device="cpu").load_checkpoint(str(damaged))
