"""Planner behaviour the rest of the suite let through when changed by one line (mutation
review, session 56): the trainer never gets fewer GPUs than its states need, the synchronous
modes try every split and give the trainer every GPU left, colocated pays no weight transfer, the
simulated stream trains the iteration's last partial micro-batch."""
import pytest

from controller.planner.allocation import StageModel, most_trainer_splits
from controller.planner.cluster import Cluster, Datacenter
from controller.planner.hardware import MODELS, gpu, trainer_min_gpus
from controller.planner.planner import Planner
from controller.planner.workloads import Trace, sample_workloads
from controller.planner.profile import TrainProfile
from controller.planner.simulator import SimConfig, Workload, simulate
from controller.scheduling import PTLProfile

LENS = [50, 80, 120, 300, 900, 2000, 60, 70, 400, 1500, 30, 250] * 4


def _planner(n=32, unit=4, intra=1600.0, model="qwen2.5-7b", **kw):
    wl = sample_workloads(Trace(LENS, [64] * len(LENS)), 48, 2, 0)
    return Planner(Cluster("c", [Datacenter("a", "H800", n, 2.0)], gen_unit=unit, trainer_unit=unit, gen_tp=1,
                           intra_gbps=intra), MODELS[model], wl, **kw)


def test_the_trainer_never_gets_fewer_gpus_than_its_states_need():
    """7B PPO needs 5 H800s: with a trainer unit of 4 that is two units, 8 GPUs (rounding down
    gave 4, and Algorithm 1 planned a trainer that cannot hold its states)."""
    p = _planner(unit=4)
    need = trainer_min_gpus(MODELS["qwen2.5-7b"], gpu("H800"), "ppo")
    assert need == 5 and p.train_min == 8
    assert p.allocate().train_gpus >= need and p.allocate(even=True).train_gpus >= need


def test_sync_splits_give_the_trainer_every_gpu_left():
    sm = StageModel(gen_time=lambda k: 100.0 / k, train_time=lambda y: 100.0 / y, train_min=2)
    assert [(a.gen_gpus, a.train_gpus, a.released_train) for a in most_trainer_splits(sm, 8)] == [
        (1, 7, 0), (2, 6, 0), (3, 5, 0), (4, 4, 0), (5, 3, 0), (6, 2, 0)]
    cross = most_trainer_splits(sm, 4, m=3)  # a trainer datacenter of 4, a generation one of 3
    assert [(a.gen_gpus, a.train_gpus, a.released_gen) for a in cross] == [(1, 4, 2), (2, 4, 1), (3, 4, 0)]


def test_the_sync_modes_simulate_several_splits():
    got = _planner().sync_candidates()
    assert len(got) >= 6, [(a.gen_gpus, a.train_gpus) for _, a in got]


def test_colocated_pays_no_weight_transfer():
    """Colocated generation reads the trainer's weights in place: the link speed changes nothing."""
    fast, slow = _planner(intra=1600.0), _planner(intra=1.0)
    times = [p.recommend(["colocated"])["colocated"].modes["colocated"]["iteration_s"] for p in (fast, slow)]
    assert times[0] == times[1]

def test_stream_trains_the_last_partial_microbatch():
    """Stream mode: tokens short of a full micro-batch at the iteration's end still train
    (here all 6 tokens, below microbatch_tokens=100): gen 4 s, then 6 s of tokens + 0.5 s step."""
    flat = PTLProfile([1], [1.0], kv_tokens=1000)
    cfg = SimConfig("stream", 1, flat, TrainProfile(s_per_token=1.0, fixed_s=0.5), sync_s=1.0,
                    microbatch_tokens=100)
    res = simulate(cfg, [Workload(out_lens=[2, 4], prompt_lens=[0, 0])])
    assert res.train_end == pytest.approx([10.5])
    assert sum(s.end - s.start for s in res.spans if s.stage == "train") == pytest.approx(6.5)
