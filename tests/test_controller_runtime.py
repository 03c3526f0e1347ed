"""End-to-end runs of controller/main.py under torchrun: real processes, real torch RPC,
real TensorBoard event files (read back with EventAccumulator)."""
import json
import re
import shutil

import pytest

from runtime_helpers import iterations, last_json, tiny_model, torchrun, write_config  # noqa: F401


@pytest.mark.slow  # test_repl covers the same logging in the default tier
def test_async_stream_run_logs_everything(tmp_path, tiny_model):  # noqa: F811
    p = torchrun(write_config(tmp_path, tiny_model))
    assert p.returncode == 0, p.stderr[-4000:]
    summary = last_json(p.stdout)
    assert summary["iterations"] == 3 and summary["mode"] == "async_stream"
    for k in ("reward_first", "reward_last", "samples_per_s", "logdir"):
        assert k in summary
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["num_samples"] for r in rows] == [8, 8, 8]
    assert rows[0]["staleness_max"] == 0 and all(r["staleness_max"] <= 1 for r in rows)
    assert [r["gen_version"] for r in rows] == [0, 0, 1]  # one-step off-policy
    assert [r["version"] for r in rows] == [1, 2, 3]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "run" / "tb"))
    ea.Reload()
    tags = ea.Tags()
    for t in ("train/reward_mean", "train/entropy", "perf/samples_per_s", "idle/gen1", "idle/train2",
              "staleness/max", "time/weight_sync_s", "balance/delta_s", "eval/mean"):
        assert t in tags["scalars"], t
    assert "train/kl" not in tags["scalars"]  # kl_coef 0: no reference policy, no KL to it
    assert len(ea.Scalars("train/reward_mean")) == 3
    assert "timeline/gantt" in tags["images"]
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())
    stages = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"generate", "train", "weight_sync"} <= stages
    assert (tmp_path / "run" / "checkpoints" / "iter_000003" / "controller.json").exists()


@pytest.mark.slow
def test_colocated_data_parallel_run(tmp_path, tiny_model):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, pipeline__mode="colocated",
                       placement__generation=[1, 2], placement__trainer=[1, 2], train__iterations=2,
                       train__eval_every=0)
    p = torchrun(cfg)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = iterations(tmp_path / "run")
    assert [r["num_samples"] for r in rows] == [8, 8]  # all-reduced over both DP ranks
    assert [r["gen_version"] for r in rows] == [0, 1] and all(r["staleness_max"] == 0 for r in rows)


def test_worker_exception_stops_the_run_with_rank_role_traceback(tmp_path, tiny_model, monkeypatch):  # noqa: F811
    # an exception inside the generation instance's generate(): raised by a test hook, since
    # what raises there in production (a CUDA error, OOM) cannot be produced on demand here
    # (bad prompts are refused at start: tests/test_prompt_check.py)
    monkeypatch.setenv("STREAMRL_TEST_RAISE_IN_GENERATE", "1")
    cfg = write_config(tmp_path, tiny_model, train__iterations=2)
    p = torchrun(cfg, timeout=120)
    assert p.returncode != 0
    assert "worker rank 1 (generation) raised in generate()" in p.stderr
    assert "Traceback" in p.stderr and "STREAMRL_TEST_RAISE_IN_GENERATE" in p.stderr
    assert not (tmp_path / "run" / "iterations.jsonl").exists()


def test_one_trainer_ranks_error_is_said_not_the_others_timeout(tmp_path, tiny_model):  # noqa: F811
    # two trainer DP ranks; the reward raises on the second (rank 3) only, and
    # trainer.on_bad_sample: error makes that the rank's error in step(). Rank 2 meanwhile waits
    # in the gradient all-reduce for rank 3 until the process group's timeout
    # (placement.collective_timeout_s). The controller says rank 3's own error: it used to wait the
    # ranks' calls in order and report rank 2's collective timeout instead, minutes later.
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(16)))
    (tmp_path / "rew.py").write_text(
        "import os\n\n\ndef score(prompt, completion):\n"
        "    if os.environ.get('RANK') == '3':\n"
        "        raise ValueError('the reward service is down (test)')\n"
        "    return 0.0\n")
    cfg = write_config(tmp_path, tiny_model, task__name="jsonl",
                       task__kwargs={"files": str(data), "verifier": f"{tmp_path / 'rew.py'}:score"},
                       trainer__on_bad_sample="error", placement__trainer=[2, 3], placement__rpc_timeout_s=600,
                       train__iterations=2, train__eval_every=0, pipeline__mode="stream")
    p = torchrun(cfg, nproc=4, timeout=300)  # the old wait hung in rank 2's all-reduce (30 min: gloo subgroup default)
    assert p.returncode != 0
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("[controller] run stopped:")]
    assert said == ["[controller] run stopped: worker rank 3 (trainer) raised in step():"], p.stderr[-4000:]
    # the cause, named: the sample and the score's own error (it used to say "reward is not finite")
    assert re.search(r"ValueError: sample \d+: the task's score raised ValueError\('the reward service is down "
                     r"\(test\)'\)", p.stderr), p.stderr[-4000:]
    assert "skipped" not in p.stderr  # refused, not skipped


def test_bad_config_stops_before_any_work(tmp_path, tiny_model, monkeypatch, capsys):  # noqa: F811
    # what each torchrun rank does first: validate against the world size, exit 2, no process
    # group (main() in this process, as torchrun's environment would start it)
    from controller.main import main

    cfg = write_config(tmp_path, tiny_model, placement__trainer=[7])
    for rank in ("0", "1"):
        for k, v in {"RANK": rank, "WORLD_SIZE": "3", "LOCAL_RANK": rank, "TORCHELASTIC_RUN_ID": "t",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():  # nothing listens there
            monkeypatch.setenv(k, v)
        assert main(["--config", str(cfg)]) == 2
        # rank 0 says it, once for the job; the other ranks exit with the same code quietly
        said = "config error: " + str(cfg) + ": placement.trainer[0]: rank 7 >= world size 3"
        err = capsys.readouterr().err
        assert (said in err) == (rank == "0"), err


@pytest.mark.slow
def test_resume_continues_the_sequence(tmp_path, tiny_model):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, train__iterations=2, train__eval_every=0)
    p = torchrun(cfg)
    assert p.returncode == 0, p.stderr[-4000:]
    cfg = write_config(tmp_path, tiny_model, train__iterations=4, train__eval_every=0)
    p = torchrun(cfg, extra=["--resume", str(tmp_path / "run")])
    assert p.returncode == 0, p.stderr[-4000:]
    assert "resumed from" in p.stderr
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]  # trainer state restored
    state = json.loads((tmp_path / "run" / "checkpoints" / "iter_000004" / "controller.json").read_text())
    assert state["iteration"] == 4 and state["stream"]["pos"] == 16  # 4 iterations x 4 prompts
    assert last_json(p.stdout)["iterations"] == 4


@pytest.mark.slow  # three launches (~90 s): with the other resume runs, out of the default suite's 15 minutes
def test_resume_writes_into_the_resumed_run_or_forks_into_an_unused_logdir(tmp_path, tiny_model):  # noqa: F811
    """``--resume A`` with ``logging.logdir`` naming another run's folder B continued into B
    (rows, steps and checkpoints of two runs interleaved). Now it continues in A; into an
    unused logdir C it forks, leaving A as it was."""
    def run(logdir, iters, *extra):
        cfg = write_config(tmp_path, tiny_model, train__iterations=iters, train__eval_every=0,
                           logging__logdir=str(tmp_path / logdir), logging__progress=True)
        p = torchrun(cfg, extra=list(extra))
        assert p.returncode == 0, p.stderr[-4000:]
        return p

    run("a", 2)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # another finished run in B (a copy: one launch less)
    p = run("b", 4, "--resume", str(tmp_path / "a"))
    assert f"continuing that run in its folder {tmp_path / 'a'}" in p.stderr
    assert [r["iteration"] for r in iterations(tmp_path / "a")] == [0, 1, 2, 3]
    assert [r["iteration"] for r in iterations(tmp_path / "b")] == [0, 1]
    assert sorted(x.name for x in (tmp_path / "b" / "checkpoints").glob("iter_*")) == ["iter_000002"]
    p = run("c", 5, "--resume", str(tmp_path / "a" / "checkpoints" / "iter_000004"))
    assert "in the new folder" in p.stderr
    assert [r["iteration"] for r in iterations(tmp_path / "c")] == [4]
    assert [r["iteration"] for r in iterations(tmp_path / "a")] == [0, 1, 2, 3]
    # stderr is a pipe here: a plain line per iteration (rich draws its bar only at the end)
    assert "[controller] iteration 5/5 (step 4, async_stream): reward " in p.stderr
    # each attempt's command line, overrides and resolved config are in its run folder
    import yaml

    first, resumed = (yaml.safe_load((tmp_path / "a" / n).read_text()) for n in ("config.yaml", "config.resume1.yaml"))
    assert first["resume"] is None and first["config"]["train"]["iterations"] == 2
    assert resumed["resume"] == str(tmp_path / "a") and resumed["config"]["train"]["iterations"] == 4
    assert resumed["config"]["engine"]["block_size"] == 16 and "--resume" in resumed["command"]  # defaults filled in


@pytest.mark.slow
def test_trainer_death_restarts_from_checkpoint(tmp_path, tiny_model):  # noqa: F811
    import os

    cfg = write_config(tmp_path, tiny_model, train__iterations=3, train__eval_every=0, train__ckpt_every=1,
                       pipeline__mode="stream")
    os.environ["STREAMRL_TEST_TRAINER_DIE_AT"] = "1"  # only on torchrun's first attempt
    try:
        p = torchrun(cfg, extra=["--resume", str(tmp_path / "run")], torchrun_args=["--max-restarts", "1"],
                     timeout=400, c10d=True)
    finally:
        del os.environ["STREAMRL_TEST_TRAINER_DIE_AT"]
    assert p.returncode == 0, p.stderr[-4000:]
    stopped = [ln for ln in p.stderr.splitlines() if "run stopped" in ln or "stopped by SIGTERM" in ln]
    # the controller sees the trainer's death first (its step, or an instance failing to stream
    # to it), or torchrun's SIGTERM first: torchrun stops every other rank once one has failed
    assert stopped and ("worker rank 2 (trainer)" in stopped[0] or "rank 1 (generation)" in stopped[0]
                        or "stopped by SIGTERM" in stopped[0]), p.stderr[-4000:]
    assert any("--resume" in ln for ln in p.stderr.splitlines() if ln.startswith("[controller]"))  # the hint
    assert "resumed from" in p.stderr
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert last_json(p.stdout)["iterations"] == 3
