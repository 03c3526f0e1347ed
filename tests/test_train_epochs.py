"""``train.epochs`` (verl's ``total_epochs``): the run's iterations derived at start from the train
prompts the start check kept, as verl's ``len(train_dataloader) * total_epochs`` with its
``drop_last`` dataloader; the LR schedule (``trainer.total_steps``, a ``warmup_ratio``'s warmup)
follows it on the trainer ranks, and a resumed run ends where the first attempt would have."""
import dataclasses

import pytest
import yaml

from controller.config import ConfigError, from_dict
from controller.epochs import iterations_of, with_epochs
from runtime_helpers import TASK, iterations, last_json, tiny_model, torchrun, write_config  # noqa: F401


def test_iterations_drop_the_last_partial_batch_of_each_epoch_as_verl():
    assert iterations_of(1, 64, 16) == 4
    assert iterations_of(3, 10, 4) == 6  # 2 full batches an epoch; 2 prompts left over each epoch
    assert iterations_of(2, 4, 4) == 2
    assert iterations_of(5, 3, 4) == 0  # with_epochs refuses it


def test_with_epochs_sets_the_iterations_and_the_schedules_length(capsys):
    cfg = from_dict({"train": {"epochs": 3, "batch_prompts": 4}, "trainer": {"lr_schedule": "cosine"}})
    assert cfg.train.iterations is None and "total_steps" in cfg.follows
    run, line = with_epochs(cfg, 10, dropped=2)
    assert (run.train.iterations, run.train.epochs, run.trainer.total_steps) == (6, 3, 6)
    assert line.startswith("train.epochs 3: 6 iterations = 3 x (10 train prompts (after the start check dropped 2) "
                           "// train.batch_prompts 4), the LR schedule's trainer.total_steps 6"), line
    assert "the 2 prompts left over an epoch are not dropped" in line
    # without train.epochs: the config as loaded, nothing said
    plain = from_dict({"train": {"iterations": 7}})
    assert with_epochs(plain, 10) == (plain, None) and plain.trainer.total_steps == 7


def test_a_total_steps_the_file_sets_stays_and_a_warmup_ratio_follows_the_derived_length():
    cfg = from_dict({"train": {"epochs": 2, "batch_prompts": 4}, "trainer": {"total_steps": 50}})
    assert "total_steps" not in cfg.follows
    assert with_epochs(cfg, 12)[0].trainer.total_steps == 50  # the run is 6 iterations; the schedule 50
    cfg = from_dict({"train": {"epochs": 2, "batch_prompts": 4}, "trainer": {"warmup_ratio": 0.25}})
    run, line = with_epochs(cfg, 12)
    assert (run.trainer.total_steps, run.trainer.warmup) == (6, 1)  # int(0.25 x 6), as verl rounds
    assert "LR warmup 1 steps (trainer.warmup_ratio 0.25)" in line


def test_fewer_prompts_than_a_batch_and_a_warmup_past_the_derived_schedule_are_config_errors():
    cfg = from_dict({"train": {"epochs": 2, "batch_prompts": 8}})
    with pytest.raises(ConfigError, match=r"train.epochs: the train split has 5 prompts \(after the start check "
                                          r"dropped 3\), fewer than one batch of train.batch_prompts 8: an epoch "
                                          r"would be no iteration"):
        with_epochs(cfg, 5, dropped=3)
    # warmup_steps is checked at load against a placeholder (itself), at start against the run
    cfg = from_dict({"train": {"epochs": 1, "batch_prompts": 4}, "trainer": {"warmup_steps": 5}})
    with pytest.raises(ConfigError, match=r"trainer.warmup_steps \(5\) must be <= trainer.total_steps \(3\).*"
                                          r"follows the 3 iterations train.epochs 1 derives from 12 train prompts"):
        with_epochs(cfg, 12)
    assert with_epochs(cfg, 20)[0].trainer.total_steps == 5


def test_iterations_and_epochs_together_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"train.iterations \(5\) and train.epochs \(2\) both set the run's length; "
                                          r"set one"):
        from_dict({"train": {"iterations": 5, "epochs": 2}})
    with pytest.raises(ConfigError, match=r"train.epochs must be an int >= 1"):
        from_dict({"train": {"epochs": 0}})
    assert from_dict({}).train.iterations == 20 and from_dict({}).train.epochs is None


def test_the_trainers_schedule_takes_the_derived_length_before_its_first_step(tmp_path):
    """``TrainerRank.set_total_steps``: the schedule, its warmup and the lr of step 0 follow."""
    from types import SimpleNamespace

    import torch

    from workers.trainer import TrainerConfig
    from workers.trainer.schedule import lr_lambda, set_total_steps

    cfg = TrainerConfig(lr=1.0, lr_schedule="linear", warmup_ratio=0.5, total_steps=1)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=cfg.lr)
    w = SimpleNamespace(cfg=cfg, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
                        actor_steps=0)  # (the schedule steps that updated the policy: TrainerWorker's)
    set_total_steps(w, 4)
    assert (w.cfg.total_steps, w.cfg.warmup) == (4, 2)
    lrs = []
    for _ in range(4):
        lrs.append(w.scheduler.get_last_lr()[0])
        opt.step()
        w.actor_steps += 1
        w.scheduler.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.5])  # warmup (s + 1) / 2, then linear over the other 2
    with pytest.raises(RuntimeError, match="after 4 scheduler steps"):
        set_total_steps(w, 8)


def _kept_prompts(model_dir: str, task: dict, max_prompt_tokens: int) -> tuple[int, int]:
    """(kept, all) train prompts of ``task`` under ``max_prompt_tokens`` with the model's template."""
    from workers.tasks.registry import make_task
    from workers.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    items = make_task("synthetic", **task).prompts("train")
    return sum(len(tok.encode_prompt(p.prompt, p.messages)) <= max_prompt_tokens for p in items), len(items)


@pytest.mark.slow  # a real run (~20 s); the default tier keeps the unit tests of the same derivation
def test_a_run_stops_after_the_iterations_its_epochs_derive_from_the_kept_prompts(tmp_path, tiny_model):  # noqa: F811
    """Real torchrun: 11 train prompts, of which train.max_prompt_tokens 6 with skip keeps 9:
    3 epochs of 9 // 5 = 1 batch are 3 iterations (11 // 5 would be 6), the linear schedule is 3
    steps long and warmup_ratio 0.5 warms up int(1.5) = 1 of them."""
    task = {**TASK, "num_train": 11}
    kept, total = _kept_prompts(tiny_model, task, 6)
    assert kept // 5 == 1 and total // 5 == 2, (kept, total)  # the data this test relies on
    cfg = write_config(tmp_path, tiny_model, task__kwargs=task, train__iterations=None, train__epochs=3,
                       train__batch_prompts=5, train__eval_every=0, train__overlong_prompts="skip",
                       train__max_prompt_tokens=6, trainer__lr_schedule="linear", trainer__warmup_ratio=0.5)
    p = torchrun(cfg)
    assert p.returncode == 0, p.stderr[-4000:]
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("[controller] train.epochs")]
    assert said == [f"[controller] train.epochs 3: 3 iterations = 3 x ({kept} train prompts (after the start check "
                    f"dropped {total - kept}) // train.batch_prompts 5), the LR schedule's trainer.total_steps 3, "
                    f"LR warmup 1 steps (trainer.warmup_ratio 0.5); the {kept % 5} prompts left over an epoch are "
                    "not dropped: the prompt stream runs on into the next epoch"], p.stderr[-3000:]
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1, 2] and last_json(p.stdout)["iterations"] == 3
    lr = 1e-3  # write_config's trainer.lr: warmup 1/1, then linear over 2 steps
    assert [r["metrics"]["lr"] for r in rows] == pytest.approx([lr, lr, lr / 2]), rows[-1]["metrics"]
    # written again with what it derived apart: the config as it loads back (the record held both
    # the epochs and the iterations, refused when loaded, and a frozen total_steps; session 53)
    whole = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    record = whole["config"]
    assert whole["derived"] == {"train.iterations": 3} and record["train"]["epochs"] == 3
    assert record["train"]["iterations"] is None and "total_steps" not in record["trainer"]


@pytest.mark.slow  # two launches (~50 s)
def test_a_resumed_run_goes_on_to_the_derived_end(tmp_path, tiny_model):  # noqa: F811
    task = {**TASK, "num_train": 8}
    common = dict(task__kwargs=task, train__batch_prompts=4, train__eval_every=0)
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=1, **common))
    assert p.returncode == 0, p.stderr[-4000:]
    cfg = write_config(tmp_path, tiny_model, train__iterations=None, train__epochs=2, **common)  # 2 x 8 // 4 = 4
    p = torchrun(cfg, extra=["--resume", str(tmp_path / "run")])
    assert p.returncode == 0, p.stderr[-4000:]
    assert "[controller] train.epochs 2: 4 iterations = 2 x (8 train prompts // train.batch_prompts 4)" in p.stderr
    assert [r["iteration"] for r in iterations(tmp_path / "run")] == [0, 1, 2, 3]
    p = torchrun(cfg, extra=["--resume", str(tmp_path / "run")])  # complete: the key to raise is epochs
    assert p.returncode == 0 and "nothing to train; raise train.epochs (--set train.epochs=N)" in p.stderr, \
        p.stderr[-3000:]


def test_the_loaded_config_holds_the_epochs_and_no_length_yet():
    cfg = from_dict({"train": {"epochs": 2}})
    assert dataclasses.asdict(cfg.train)["iterations"] is None  # derived at start (the run folder's config.yaml
    assert cfg.trainer.total_steps == 1  # is written again then); a placeholder until then (warmup_steps, or 1)


def test_the_both_set_error_names_the_key_to_unset_either_way(tmp_path):
    """A file with train.epochs continued with ``--set train.iterations=N`` (the natural way to
    lengthen a run) was told to unset train.iterations, the key it had just set."""
    from controller.config import load_config

    p = tmp_path / "c.yaml"
    p.write_text("train:\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"--set train.iterations=null or train.epochs=null unsets a file's"):
        load_config(p, None, ["train.iterations=10"])
    assert load_config(p, None, ["train.iterations=10", "train.epochs=null"]).train.iterations == 10


def test_too_few_prompts_for_a_batch_are_said_before_the_engines_start(tmp_path, tiny_model):  # noqa: F811
    """Real torchrun: 3 train prompts and batch_prompts 5 cannot make one iteration whatever the
    prompt check keeps; the run stops with the config error before any worker builds an engine."""
    cfg = write_config(tmp_path, tiny_model, task__kwargs={**TASK, "num_train": 3}, train__iterations=None,
                       train__epochs=2, train__batch_prompts=5, train__eval_every=0)
    p = torchrun(cfg)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("config error: ")]
    assert p.returncode != 0 and errors == [
        "config error: train.epochs: the train split has 3 prompts, fewer than one batch of train.batch_prompts 5: "
        "an epoch would be no iteration (verl drops the last partial batch); lower train.batch_prompts, or set "
        "train.iterations instead"], p.stderr[-3000:]
    assert "[generation" not in p.stderr, p.stderr[-3000:]
