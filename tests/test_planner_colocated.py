"""Colocated generation through the runtime path in two processes (planner host profile), and
the simulator's use of it: an instance slows down only where another instance generates."""
import numpy as np
import pytest
import torch
from runtime_helpers import TASK, tiny_model  # noqa: F401

from controller.planner.colocated import ColocatedGenProfile, measure_colocated_generation, thread_shares
from controller.planner.profile import TrainProfile
from controller.planner.simulator import SimConfig, Workload, simulate
from controller.scheduling import PTLProfile
from workers.generation.config import EngineConfig
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained

FLAT = PTLProfile([1], [1.0], kv_tokens=1000)  # 1 s per decode step
TRAIN = TrainProfile(s_per_token=1.0, fixed_s=0.5)


def test_two_instances_generate_together_and_alone_over_rpc(tmp_path):
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=3)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    batches = [([3, 5, 2, 4], [4, 4, 6, 5]), ([1, 6, 2, 2], [5, 3, 3, 3])]
    # raises unless every generated sample reached a trainer sink over RPC (both directions)
    r = measure_colocated_generation(EngineConfig(device="cpu", max_batch_size=4), str(tmp_path / "m"), batches,
                                     window_s=0.0, vocab=64)
    assert len(r.alone_s) == len(r.together_s) == 2
    assert all(x > 0 for x in r.alone_s + r.together_s)
    assert r.slowdown == pytest.approx(float(np.median([t / a for t, a in zip(r.together_s, r.alone_s)])))
    for t in (r.alone_threads, r.together_threads):
        assert t["wall_s"] > 0 and t["cpu_s"] >= 0 and 0 <= t["runq_share"] <= 1
    r.save(tmp_path / "colocated.json")  # saved and reused like the stage profiles
    assert ColocatedGenProfile.load(tmp_path / "colocated.json") == r
    with pytest.raises(ValueError, match="no batches"):
        measure_colocated_generation(EngineConfig(device="cpu"), str(tmp_path / "m"), [])
    with pytest.raises(ValueError, match=">= 2 requests"):
        measure_colocated_generation(EngineConfig(device="cpu"), str(tmp_path / "m"), [([3], [4])])


def test_colocated_profile_file_errors_name_the_problem(tmp_path):
    (tmp_path / "p.json").write_text('{"alone_s": [0.1]}')
    with pytest.raises(ValueError, match="missing"):
        ColocatedGenProfile.load(tmp_path / "p.json")
    with pytest.raises(ValueError, match="one length"):
        ColocatedGenProfile([0.1, 0.2], [0.3], 1.5)


def test_thread_shares_split_wall_into_cpu_runqueue_and_blocked():
    reps = [[{"wall_s": 1.0, "cpu_s": 0.5, "runq_s": 0.3}], [{"wall_s": 1.0, "cpu_s": 0.6, "runq_s": 0.2}]]
    t = thread_shares(reps)
    assert t["wall_s"] == 2.0 and t["cpu_s"] == pytest.approx(1.1) and t["runq_s"] == pytest.approx(0.5)
    assert t["blocked_s"] == pytest.approx(0.4) and t["runq_share"] == pytest.approx(0.25)


def colocated(n, **kw):
    cfg = SimConfig("colocated", n, FLAT, TRAIN, dispatcher="round_robin", train_ranks=2, colocated_dp=True, **kw)
    return simulate(cfg, [Workload(out_lens=[2, 4], prompt_lens=[0, 0])])


def test_colocated_timeline_slows_an_instance_only_while_the_other_generates():
    # round robin: gen0 has the 2-token request, gen1 the 4-token one; gen0 runs alongside
    # the first half of gen1 -> gen1 stretches by 1 + (2 - 1) * 0.5 (fixed point: 3 of 6 s)
    r = colocated(2, gen_colocated_slowdown=2.0)
    gen = sorted((sp.worker, sp.start, sp.end) for sp in r.spans if sp.stage == "generate")
    assert gen == [("gen0", 0.0, 3.0), ("gen1", 0.0, 6.0)] and r.gen_end == [6.0]
    assert colocated(2).gen_end == [4.0]
    assert colocated(1, gen_colocated_slowdown=2.0).gen_end == [4.0]  # one instance: nothing to share with


def test_colocated_training_overlap_uses_the_cross_stage_factor():
    # rank 0's sample is in at gen0's end and it trains over the rest of gen1: that share of
    # gen1 takes gen_shared_slowdown, the share beside gen0 gen_colocated_slowdown
    r = colocated(2, gen_colocated_slowdown=2.0, gen_shared_slowdown=3.0)
    assert r.gen_end == [pytest.approx(10.0)]  # 4 s * (1 + 1 * 0.5 + 2 * 0.5)
    with pytest.raises(ValueError, match="gen_colocated_slowdown"):
        SimConfig("colocated", 2, FLAT, TRAIN, gen_colocated_slowdown=0.9)


def test_two_dp_ranks_train_together_with_the_trainers_all_reduce(tiny_model):  # noqa: F811
    from controller.planner.colocated import measure_colocated_training
    from workers.trainer.config import TrainerConfig

    torch.set_num_threads(1)
    r = measure_colocated_training(TrainerConfig(algorithm="grpo", max_tokens_per_microbatch=64), tiny_model,
                                   "synthetic", dict(TASK), [4, 6, 3], [5, 5, 7], 2, tokens=40, iterations=2)
    assert len(r["together_s"]) == 2 and all(x > 0 for x in r["together_s"])
    assert r["threads"]["wall_s"] > 0 and 0 <= r["threads"]["runq_share"] <= 1
    with pytest.raises(ValueError, match="iterations and tokens"):
        measure_colocated_training(TrainerConfig(), tiny_model, "synthetic", dict(TASK), [4], [5], 2, tokens=0)


def test_colocated_dp_ranks_slow_down_by_the_share_another_rank_trains():
    # rank 0 trains 2..4 while only gen1 runs (cross-stage factor), then waits/steps with rank 1
    base = colocated(2).train_end[0]
    both = colocated(2, train_colocated_slowdown=2.0).train_end[0]
    old_rule = colocated(2, train_shared_slowdown=2.0).train_end[0]  # every rank's whole training x2
    assert base == pytest.approx(8.5)  # rank 1: its sample at 4 s, 4 s of training, 0.5 s step
    assert old_rule == pytest.approx(13.0)  # rank 1: 4 + 4 x 2 + 0.5 x 2
    assert base < both < old_rule  # x2 only over the share beside the other rank's training


def test_train_tokens_hands_samples_over_in_finish_order_in_chunks_each_once(tiny_model, monkeypatch):  # noqa: F811
    # the trainer rank gets samples as the instance finishes them; planner_accuracy's trainer
    # profile and train_handover_s time that order (micro-batches are cut in arrival order)
    from controller.planner.host import make_train_tokens
    from workers.trainer.config import TrainerConfig
    from workers.trainer.worker import TrainerWorker

    torch.set_num_threads(1)
    calls = []
    receive = TrainerWorker.receive
    monkeypatch.setattr(TrainerWorker, "receive", lambda self, s: (calls.append([len(x.output_ids) for x in s]),
                                                                   receive(self, s))[1])
    train = make_train_tokens(TrainerConfig(algorithm="grpo", max_tokens_per_microbatch=64), tiny_model,
                              "synthetic", dict(TASK), [4, 6, 3], [5, 5, 7], 2)
    train(60)  # the workload's lengths cycled: 4 6 3 4 6 3 ..., whole groups of 2
    assert len(calls) == 1
    one = calls.pop()
    assert one == sorted(one) and sorted(set(one)) == [3, 4, 6]  # shortest finish first
    train(60, handovers=3)
    assert len(calls) == 3 and all(calls)
    assert [n for c in calls for n in c] == one  # the same order, cut into 3 hand-overs


def test_finish_order_follows_continuous_batching_with_a_cap():
    from controller.planner.host import finish_order

    assert finish_order([5, 1, 3], [2, 2, 2]) == [1, 2, 0]  # all running: by length
    # 2 running: 0 (5 steps) and 1 (1 step) first; 2 starts when 1 ends and needs 3 more (ends
    # at 4, before 0); 3 starts at 4 and ends at 5, tied with 0 (admitted earlier: first)
    assert finish_order([5, 1, 3, 1], [2, 2, 2, 2], max_batch=2) == [1, 2, 0, 3]


def test_outbox_send_times_follow_the_window_and_flush_at_the_end():
    from controller.planner.simulator import outbox_send_times

    # 1.0 opens a window to 1.5 (1.2 joins it); 2.0 opens one to 2.5; 2.9 opens one the
    # instance's end (3.0) closes early
    assert outbox_send_times([1.2, 1.0, 2.0, 2.9], 0.5, 3.0) == [1.5, 1.5, 2.5, 3.0]
    assert outbox_send_times([1.2, 1.0], 0.0, 3.0) == [1.2, 1.0]  # no window: at the finish


def test_simulated_stream_trainer_waits_for_the_outbox_window():
    wl = [Workload([1, 5], [1, 1])]  # 1 s per step: samples finish at 1 and 5
    cfg = SimConfig("stream", 1, FLAT, TRAIN, microbatch_tokens=1)
    first = lambda r: min(sp.start for sp in r.spans if sp.stage == "train")  # noqa: E731
    assert first(simulate(cfg, wl)) == pytest.approx(1.0)
    assert first(simulate(SimConfig("stream", 1, FLAT, TRAIN, microbatch_tokens=1, stream_window_s=0.5), wl)) \
        == pytest.approx(1.5)


def test_simulated_streaming_trainer_pays_the_handover_cost_per_handover():
    wl = [Workload([2, 2, 2, 2], [1, 1, 1, 1])]
    base = simulate(SimConfig("stream", 1, FLAT, TRAIN, microbatch_tokens=3), wl)
    paid = simulate(SimConfig("stream", 1, FLAT, TRAIN, microbatch_tokens=3, train_overhead_per_batch_s=0.25), wl)
    # four 3-token samples, micro-batches of >= 3 tokens: four hand-overs
    assert paid.train_end[0] - base.train_end[0] == pytest.approx(4 * 0.25)
