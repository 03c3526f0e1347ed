"""Generations written out for people to read (verl's ``trainer.rollout_data_dir``,
``validation_data_dir``, ``log_val_generations``): a real 3-process run writes each iteration's
scored samples (``<dir>/<iteration>.jsonl`` from the trainer rank) and each evaluation's
generations (``<dir>/<step>.jsonl`` from the controller, named in its eval.jsonl row), the
rewards in them being the task's own score of the text written; the first N go to
TensorBoard's text panel. Resuming rewrites the iterations it runs again, whole."""
import json

from pathlib import Path

from runtime_helpers import TASK, tiny_model, torchrun, write_config  # noqa: F401
from test_trainer_stats import model_dir  # noqa: F401

from controller.evaluation import EvalResult
from controller.metrics import Metrics
from workers.generation_dump import markdown, write_rows
from workers.tasks import make_task
from types import SimpleNamespace
import torch
from workers.trainer.rollout_dump import rollout_row
from workers.types import Sample, TaskPrompt


def _rows(path):
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines()]


def test_a_run_writes_its_rollouts_and_evaluations(tmp_path, tiny_model):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rollouts, evals = tmp_path / "rollouts", tmp_path / "evals"
    cfg = write_config(tmp_path, tiny_model, train__iterations=2, train__eval_before_train=True,
                       logging__rollout_data_dir=str(rollouts), logging__validation_data_dir=str(evals),
                       logging__log_val_generations=2)
    # another run's files in the same folders (a relative path is the launch folder's): a fresh
    # run deletes none of them (it replaces the names it writes, as verl's)
    for folder, names in ((rollouts, ("5.jsonl", "7.rank1.jsonl", "notes.jsonl")), (evals, ("4.jsonl",))):
        folder.mkdir()
        for name in names:
            (folder / name).write_text("{}\n")
    p = torchrun(cfg, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    task = make_task("synthetic", **TASK)
    answers = {t.answer for t in task.prompts("train")}
    assert sorted(f.name for f in rollouts.iterdir()) == ["0.jsonl", "1.jsonl", "5.jsonl", "7.rank1.jsonl", "notes.jsonl"]
    for it in (0, 1):
        rows = _rows(rollouts / f"{it}.jsonl")
        assert len(rows) == 4 * 2 and {r["step"] for r in rows} == {it}  # batch_prompts x group_size
        assert sorted(r["group_id"] for r in rows) == sorted(r["group_id"] for r in rows[:8])
        for r in rows:
            assert set(r) >= {"input", "output", "gts", "score", "sample_id", "weight_version", "finish_reason"}
            assert r["gts"] in answers and 0.0 <= r["score"] <= 1.0 and r["env_reward"] == 0.0
    # the controller's evaluations: before training (-1) and after iteration 1 (eval_every 2)
    assert sorted(f.name for f in evals.iterdir()) == ["-1.jsonl", "1.jsonl", "4.jsonl"]
    evals_logged = [json.loads(ln) for ln in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    test = {t.prompt: t for t in task.prompts("test")}
    for row in evals_logged:
        gens = _rows(evals / f"{row['iteration']}.jsonl")
        assert row["generations"] == str(evals / f"{row['iteration']}.jsonl") and len(gens) == 4
        scored = [g["score"] for g in gens if g["score"] is not None]
        assert abs(sum(scored) / len(scored) - row["eval/mean"]) < 1e-9  # the same scores as eval/mean
        for g in gens:  # the score is the task's of the output written
            item = next(t for q, t in test.items() if q in g["input"])
            assert g["gts"] == item.answer and g["score"] == task.score(item, g["output"])
    ea = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"tensors": 0})
    ea.Reload()
    assert "eval/generations/text_summary" in ea.Tags()["tensors"]  # (TensorBoard's name for add_text)


def test_a_resume_from_an_older_checkpoint_drops_the_abandoned_iterations_files(tmp_path, tiny_model):  # noqa: F811
    """A run folder resumed from an older checkpoint of its own drops the later iterations' rows
    from iterations.jsonl and eval.jsonl; their rollout files and the generations those eval rows
    named stayed beside the new lineage's (flows review, s57). Other files stay."""
    rollouts, evals = tmp_path / "rollouts", tmp_path / "evals"
    logs = dict(logging__rollout_data_dir=str(rollouts), logging__validation_data_dir=str(evals))
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=3, train__ckpt_every=1, train__eval_every=1,
                              **logs), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name for f in rollouts.iterdir()) == ["0.jsonl", "1.jsonl", "2.jsonl"]
    assert sorted(f.name for f in evals.iterdir()) == ["0.jsonl", "1.jsonl", "2.jsonl"]
    (rollouts / "notes.jsonl").write_text("{}\n")
    first = {f.name: f.read_text() for f in rollouts.iterdir()}
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=2, train__ckpt_every=1, train__eval_every=1,
                              **logs), extra=["--resume", str(tmp_path / "run" / "checkpoints" / "iter_000001")],
                 timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(f.name for f in rollouts.iterdir()) == ["0.jsonl", "1.jsonl", "notes.jsonl"]
    assert (rollouts / "0.jsonl").read_text() == first["0.jsonl"] and (rollouts / "notes.jsonl").exists()
    assert {r["step"] for r in _rows(rollouts / "1.jsonl")} == {1}  # written again by the resumed run
    assert sorted(f.name for f in evals.iterdir()) == ["0.jsonl", "1.jsonl"]
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and all(Path(r["generations"]).exists() for r in rows)


def test_log_eval_writes_a_repl_evals_generations_apart_and_markdown_keeps_the_text(tmp_path):
    gens = [{"prompt": 0, "task": "sum", "input": "1 + 1 =", "output": "2 ```x```", "gts": "2", "score": 1.0},
            {"prompt": 1, "task": "sum", "input": "2 + 2 =", "output": "héllo", "gts": "4", "score": None}]
    m = Metrics(tmp_path / "run", timeline_every=0, validation_data_dir=str(tmp_path / "v"), log_val_generations=1)
    m.log_eval(EvalResult({"eval/mean": 1.0}, 2, 2, 2, 1, 100.0, 1.0, generations=gens), 3)
    m.log_eval(EvalResult({"eval/mean": 1.0}, 2, 2, 2, 1, 100.0, 1.0, generations=gens), 3, source="repl")
    m.close()
    assert [r["output"] for r in _rows(tmp_path / "v" / "3.jsonl")] == ["2 ```x```", "héllo"]
    assert [r["step"] for r in _rows(tmp_path / "v" / "3.repl_p2.jsonl")] == [3, 3]
    text = markdown(gens, 1)
    assert "1 + 1 =" in text and "2 '''x'''" in text and "2 + 2" not in text  # (a fence in the text cannot end the block)
    write_rows(tmp_path / "v", "3", gens[:1])  # a resumed run's same step: replaced whole
    assert len(_rows(tmp_path / "v" / "3.jsonl")) == 1


def test_each_repl_eval_keeps_its_own_generations_file(tmp_path):
    """(Two REPL evals at one step with one prompt count wrote one file: the first's was lost and
    its eval.jsonl row named the second's.)"""
    m = Metrics(tmp_path / "run", timeline_every=0, validation_data_dir=str(tmp_path / "v"))
    for out in ("first", "second"):
        g = [{"prompt": 0, "task": "t", "input": "q", "output": out, "gts": "a", "score": 1.0}]
        m.log_eval(EvalResult({"eval/mean": 1.0}, 1, 1, 1, 1, 100.0, 1.0, generations=g), 3, source="repl")
    m.close()
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["generations"] for r in rows] == [str(tmp_path / "v" / "3.repl_p1.jsonl"),
                                                str(tmp_path / "v" / "3.repl_p1.2.jsonl")]
    assert [_rows(Path(r["generations"]))[0]["output"] for r in rows] == ["first", "second"]


def test_remaxs_greedy_samples_are_kept_as_baselines(model_dir):  # noqa: F811
    """(The greedy baselines never reached the rows: they are scored apart from prepare_batch.)"""
    from test_remax import _samples, _worker

    from workers.trainer.rollout_dump import take_rows

    samples, prompts, sizes = _samples(model_dir)
    w = _worker(model_dir)
    w.rollout_rows = []
    w.begin_iteration(0, prompts, sizes)
    w.receive(samples)
    w.step()
    rows = take_rows(w)
    assert len(rows) == len(samples) and sum(r["baseline"] for r in rows) == sum(s.baseline for s in samples) == 3


def test_a_resume_on_other_ranks_replaces_the_iterations_files(tmp_path):
    """A run resumed on another number of trainer ranks left the old layout's files of the
    iterations it ran again beside the new ones (two answers for one iteration)."""
    from workers.generation_dump import stale_rows

    for name in ("3.jsonl", "3.rank0.jsonl", "3.rank1.jsonl", "3.rank2.jsonl", "4.rank1.jsonl", "13.rank1.jsonl",
                 "3.rank1.notes.jsonl"):
        (tmp_path / name).write_text("{}\n")
    stale_rows(tmp_path, 3, 2)  # two ranks write 3.rank0 and 3.rank1 now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["13.rank1.jsonl", "3.rank0.jsonl", "3.rank1.jsonl",
                                                          "3.rank1.notes.jsonl", "4.rank1.jsonl"]
    stale_rows(tmp_path, 3, 1)  # one rank writes 3.jsonl
    assert sorted(p.name for p in tmp_path.iterdir()) == ["13.rank1.jsonl", "3.rank1.notes.jsonl", "4.rank1.jsonl"]



def test_dropping_an_abandoned_lineages_rollouts_that_fails_is_said_not_raised(tmp_path, caplog, monkeypatch):
    """The deletion fails the resume no more than a failed dump fails a step. The failure is a
    fake (rows_from raising): the suite runs as root, whom no folder refuses."""
    import controller.trainer_rank as trainer_rank

    rank = trainer_rank.TrainerRank.__new__(trainer_rank.TrainerRank)  # the call touches its folder only
    (tmp_path / "r").mkdir()
    for name in ("1.jsonl", "2.jsonl", "3.rank1.jsonl", "x.jsonl"):
        (tmp_path / "r" / name).write_text("{}\n")
    rank.rollout_data_dir = str(tmp_path / "r")
    assert rank.drop_rollouts_from(2) == 2
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["1.jsonl", "x.jsonl"]

    def refused(folder, step):
        raise PermissionError(13, "Permission denied", folder)

    monkeypatch.setattr(trainer_rank, "rows_from", refused)
    assert rank.drop_rollouts_from(1) == 0 and "were not deleted ([Errno 13] Permission denied" in caplog.text


# ---- mutation review, session 59 ------------------------------------------------------------
def test_a_rollout_row_keeps_the_version_that_generated_the_sample():
    """The dump's weight_version is the sample's (the weights that sampled it), not the trainer's
    newer one (async / off-policy lag). The worker stand-in holds only what rollout_row reads
    (_prompts, _version): a real TrainerWorker a version ahead needs a step of training first."""
    s = Sample(sample_id=7, prompt_ids=torch.tensor([1, 2]), output_ids=torch.tensor([3]),
               logprobs=torch.tensor([-0.5]), weight_version=2, finish_reason="stop", group_id=1)
    w = SimpleNamespace(_prompts={7: TaskPrompt(prompt="q", answer="a", task="t")}, _version=3, version=3)
    row = rollout_row(w, s, 1.0)
    assert (row["weight_version"], row["gts"], row["score"], row["group_id"]) == (2, "a", 1.0, 1)
