"""Data parallel: 2 trainer ranks (gloo, local processes, samples split by group) produce the
same update as 1 rank on all the samples (ranks started by ``run_local``)."""
from dataclasses import replace

import pytest
import torch

from workers.model import ModelConfig
from workers.tasks import make_task
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.rollout import rollout
from workers.trainer.grads import all_reduce_sum
from workers.weight_sync.localrun import run_local
from tests.trainer_helpers import LengthRewardTask

TINY = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


def _task():
    return LengthRewardTask(make_task("synthetic", max_terms=3, num_train=64, num_test=16))


CONFIGS = [dict(algorithm="grpo", kl_coef=0.05, loss_agg="token_mean"),
           dict(algorithm="ppo", loss_agg="seq_mean", entropy_coef=0.01, ppo_epochs=2),
           # whitened over both ranks' tokens; an adaptive KL coefficient every rank updates alike
           dict(algorithm="reinforce_plus_plus_baseline", kl_coef=0.05, kl_mode="reward", kl_target=0.001,
                kl_horizon=20),
           dict(algorithm="gpg"),  # its scale counts both ranks' samples
           dict(algorithm="remax", kl_coef=0.05, kl_mode="reward")]  # a group's baseline on its members' rank


def _for(cfg_kw, samples):
    """The samples as ``cfg_kw``'s algorithm takes them: under remax the last of each group is its
    baseline (a sampled one standing in for the greedy response: the trainer reads its score only)."""
    if cfg_kw["algorithm"] != "remax":
        return samples
    last = {s.group_id: s.sample_id for s in sorted(samples, key=lambda s: s.sample_id)}
    return [replace(s, baseline=last[s.group_id] == s.sample_id) for s in samples]


def _run(rank, world, model_dir, data):
    """Rank ``rank``'s results: the weights and result of each of CONFIGS (rank 0), of a
    mini-batched step, and a bucketed all-reduce."""
    samples, prompts, groups = data
    out = {"configs": []}
    for cfg_kw in CONFIGS:
        w = TrainerWorker(TrainerConfig(**_common(cfg_kw)), model_dir, _task(), rank=rank, world_size=world,
                          device="cpu")
        mine = [s for s in _for(cfg_kw, samples) if s.group_id % world == rank]  # whole groups per rank
        w.begin_iteration(0, prompts, groups)
        for s in mine:  # streamed one by one
            w.receive([s])
        res = w.step()
        out.setdefault("kl_coef", []).append(w.kl.value)
        if rank == 0:
            out["configs"].append(({k: v.clone() for k, v in w.named_weights()}, res))
    # mini-batches: each rank splits its own micro-batches into 3 shares (some empty); every
    # rank runs the same all-reduces, so they stay in step and identical
    w = TrainerWorker(TrainerConfig(**_common(dict(algorithm="grpo", mini_batches=3))), model_dir, _task(),
                      rank=rank, world_size=world, device="cpu")
    w.begin_iteration(0, prompts, groups)
    w.receive([s for s in samples if s.group_id % world == rank])
    res = w.step()
    out["mini"] = ({k: v.clone() for k, v in w.named_weights()}, res)
    # the bucketed all-reduce across several small buckets
    ts = [torch.full((5,), rank + 1.0), torch.full((3, 2), 2.0 * (rank + 1)), torch.full((40,), rank + 1.0)]
    all_reduce_sum(ts, None, bucket_bytes=64)
    out["buckets"] = ts
    return out


def _common(cfg_kw):
    return dict(cfg_kw, lr=1e-2, adam_eps=1.0, max_tokens_per_microbatch=48)


def test_two_ranks_equal_one_rank(tmp_path):
    torch.set_num_threads(1)
    model_dir = str(build_model_dir(tmp_path / "m", _task().base, TINY, seed=0)[0])
    ref = TrainerWorker(TrainerConfig(), model_dir, _task(), device="cpu")
    samples, prompts, groups = rollout(ref.actor, ref.tokenizer, _task().prompts("train")[:4], 3, 12, seed=5)
    ranks = run_local(2, _run, model_dir, (samples, prompts, groups))
    ts = ranks[0]["buckets"]
    assert [t.unique().tolist() for t in ts] == [[3.0], [6.0], [3.0]] and ts[1].shape == (3, 2)
    (m0, r0), (m1, r1) = (ranks[r]["mini"] for r in (0, 1))
    assert r0.metrics["updates"] == r1.metrics["updates"] >= 2.0 and r0.num_samples == len(samples)
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    for i, cfg_kw in enumerate(CONFIGS):
        one = TrainerWorker(TrainerConfig(**_common(cfg_kw)), model_dir, _task(), device="cpu")
        one.begin_iteration(0, prompts, groups)
        one.receive(_for(cfg_kw, samples))
        r1 = one.step()
        w1 = {k: v.clone() for k, v in one.named_weights()}
        w2, r2 = ranks[0]["configs"][i]
        assert r2.version == r1.version == 1
        trained = len(samples) - (len(groups) if cfg_kw["algorithm"] == "remax" else 0)
        assert r2.num_samples == r1.num_samples == trained and r2.num_tokens == r1.num_tokens
        assert r2.metrics["reward_mean"] == pytest.approx(r1.metrics["reward_mean"])
        assert r2.metrics["grad_norm"] == pytest.approx(r1.metrics["grad_norm"], rel=1e-4)
        for k in w1:
            assert torch.allclose(w1[k], w2[k], atol=1e-6, rtol=1e-5), (cfg_kw, k)
        assert ranks[0]["kl_coef"][i] == ranks[1]["kl_coef"][i] == pytest.approx(one.kl.value, rel=1e-6)
    adaptive = next(i for i, c in enumerate(CONFIGS) if c.get("kl_target"))
    assert ranks[0]["kl_coef"][adaptive] != 0.05  # adapted (was [-1]: vacuous once gpg, kl_coef 0, came last)


def _late_peer(rank, world, late_s, rpc_timeout_s, collective_timeout_s):
    import time

    from controller.process_state import LOCAL, subgroup

    LOCAL.has_process_group, LOCAL.rpc_timeout_s = True, rpc_timeout_s
    group = subgroup([0, 1], collective_timeout_s)
    if rank == 1:  # behind (a slow reward, more tokens): joins the all-reduce late; or frozen
        time.sleep(late_s)
        if late_s > collective_timeout_s:
            return "slept"
    try:
        all_reduce_sum([torch.ones(3)], group)
    except RuntimeError as e:
        return f"raised: {e}"
    return "returned"


def test_dp_subgroup_waits_for_a_late_peer_past_rpc_timeout():
    # real gloo ranks: the trainers' DP group is made by controller.process_state.subgroup. A peer still
    # scoring its samples is waited for past rpc_timeout_s (the run died after 300 s, the error
    # naming the rank that waited); liveness is the heartbeat's (rpc_timeout_s)
    out = run_local(2, _late_peer, 3.0, 1.0, 30.0)
    assert out == ["returned", "returned"], out


def test_dp_subgroup_times_out_after_collective_timeout_not_torchs_30_min():
    # a peer that never joins fails the all-reduce after placement.collective_timeout_s
    out = run_local(2, _late_peer, 8.0, 1.0, 2.0)
    assert out[1] == "slept"
    assert out[0].startswith("raised:") and "imed out" in out[0], out[0]
