"""remax in the planner: each prompt's greedy baseline response is generation work that trains
nothing (``sample_workloads(greedy_group=n)``, ``Workload.trained``). The batch's trained draws are
unchanged, the simulator generates the greedy ones and trains only the others, the plan's
samples/s counts trained samples, and the CLI asks for ``--group-size`` with remax only."""
import json

import pytest

from controller.planner.__main__ import main
from controller.planner.simulator import SimConfig, Workload, simulate
from controller.planner.profile import TrainProfile
from controller.planner.workloads import Trace, sample_workloads
from controller.scheduling import PTLProfile

TRACE = Trace([50, 80, 120, 300, 900, 60, 70, 200], [64] * 8)
DC = "datacenters:\n  - {name: a, gpu: H800, gpus: 16, price_per_gpu_hour: 2.0}\n"


def test_greedy_responses_add_generation_not_training():
    plain = sample_workloads(TRACE, 12, 3, seed=5)
    remax = sample_workloads(TRACE, 12, 3, seed=5, greedy_group=5)
    for p, r in zip(plain.iterations, remax.iterations):
        assert r.out_lens[:12] == p.out_lens and r.prompt_lens[:12] == p.prompt_lens  # the same samples
        assert len(r.out_lens) == 12 + 3 and r.trained == [True] * 12 + [False] * 3  # ceil(12 / 5) prompts
        assert r.groups == [0] * 5 + [1] * 5 + [2] * 2 + [0, 1, 2]  # each prompt's greedy response in its group
        assert p.trained is None and p.trains == [True] * 12
    assert remax.tokens_per_iteration == plain.tokens_per_iteration and remax.tokens == plain.tokens


def _sim(w: Workload, mode: str = "batch"):
    prof = PTLProfile([1, 4], [0.01, 0.012], kv_tokens=100_000, max_batch_size=4, prefill_s_per_token=1e-4)
    cfg = SimConfig(mode, 2, prof, TrainProfile(s_per_token=1e-3, fixed_s=0.5), minibatch_size=2,
                    microbatch_tokens=0)
    return simulate(cfg, [w, w, w])


@pytest.mark.parametrize("mode", ["batch", "stream", "async_stream"])
def test_the_simulator_generates_greedy_requests_and_trains_only_the_samples(mode):
    samples = Workload([100, 40, 60, 80], [10] * 4)
    greedy = Workload([100, 40, 60, 80, 300, 300], [10] * 6, trained=[True] * 4 + [False] * 2)
    a, b = _sim(samples, mode), _sim(greedy, mode)
    train = lambda r: sum(s.end - s.start for s in r.spans if s.stage == "train" and s.iteration == 1)
    assert train(b) == pytest.approx(train(a))  # (4 samples x 1e-3 s a token + 0.5) the same training
    assert train(a) == pytest.approx(1e-3 * (sum(samples.out_lens) + 40) + 0.5)
    assert b.gen_end[1] - b.gen_start[1] > a.gen_end[1] - a.gen_start[1]  # the greedy ones generate
    assert b.steady_iteration_s() >= a.steady_iteration_s()


@pytest.mark.parametrize("mode", ["batch", "stream", "colocated", "async_stream"])
@pytest.mark.parametrize("groups", [None, [0, 0, 1, 1, 0, 1]])
def test_a_group_trains_only_once_its_greedy_response_is_in(mode, groups):
    """remax's advantages need the greedy reward: the trainer (and the step, and so the next
    iteration in the modes without lag) waits for the greedy responses (were free work)."""
    w = Workload([20, 20, 20, 20, 2000, 30], [10] * 6, groups=groups, trained=[True] * 4 + [False] * 2)
    r = _sim(w, mode)
    for i in range(3):
        assert r.train_end[i] >= r.gen_end[i] > r.gen_start[i] + 1.0, (mode, i)
    if groups is not None:  # group 1's samples (greedy response 30 tokens) train before group 0's
        first = min(s.start for s in r.spans if s.stage == "train" and s.iteration == 0)
        assert first < r.gen_end[0] or mode in ("batch", "colocated")


def test_a_workload_whose_flags_do_not_match_is_refused():
    with pytest.raises(ValueError, match="workload 0 has 2 out_lens, 2 prompt_lens, 1 trained flags"):
        _sim(Workload([1, 2], [3, 4], trained=[True]))


def _plan(tmp_path, capsys, *extra):
    """A batch large enough that generation is busy (more requests take longer)."""
    (tmp_path / "c.yaml").write_text(DC)
    (tmp_path / "trace.json").write_text(json.dumps([400] * 8))
    main(["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "qwen2.5-7b", "--trace",
          str(tmp_path / "trace.json"), "--batch", "2048", "--iterations", "4", *extra])
    return json.loads(capsys.readouterr().out)


def test_a_remax_plan_counts_the_greedy_generation(tmp_path, capsys):
    grpo = _plan(tmp_path, capsys, "--algorithm", "grpo")["recommended"]
    remax = _plan(tmp_path, capsys, "--algorithm", "remax", "--group-size", "4")["recommended"]
    for mode in grpo:  # the same training, more generation: never faster
        assert remax[mode]["samples_per_s"] <= grpo[mode]["samples_per_s"], mode
    for mode in ("colocated", "batch", "stream"):  # generation on the critical path: slower
        assert remax[mode]["samples_per_s"] < grpo[mode]["samples_per_s"], mode


@pytest.mark.parametrize("args, said", [(["--algorithm", "remax"], "--algorithm remax needs --group-size N"),
                                        (["--algorithm", "grpo", "--group-size", "4"], "--group-size is remax's")])
def test_group_size_is_remaxs_and_remax_needs_it(tmp_path, capsys, args, said):
    with pytest.raises(SystemExit) as e:
        _plan(tmp_path, capsys, *args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and "Traceback" not in err
