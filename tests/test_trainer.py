"""TrainerWorker: API, streaming == one batch, checkpoint resume, bf16 (staleness, bad input and
non-finite losses: test_trainer_robustness.py; config validation and LR schedules:
test_trainer_config.py)."""
import math
import random

import pytest
import torch

from workers.model import ModelConfig
from workers.tasks import make_task
from workers.trainer import StepResult, TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.rollout import rollout

torch.set_num_threads(1)
TINY = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)


class CharTask:
    """Deterministic dense reward on any completion (random tiny models score 0 on real tasks)."""

    def __init__(self, base, value=None):
        self.base, self.value = base, value

    def prompts(self, split):
        return self.base.prompts(split)

    def score(self, prompt, completion):
        return self.value if self.value is not None else (len(completion) % 5) / 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    task = make_task("synthetic", max_terms=3, num_train=64, num_test=16)
    folder, _ = build_model_dir(tmp_path_factory.mktemp("m") / "tiny", task, TINY, seed=0)
    return str(folder)


@pytest.fixture(scope="module")
def task():
    return CharTask(make_task("synthetic", max_terms=3, num_train=64, num_test=16))


def make_samples(model_dir, task, groups=4, n=3, version=0, seed=0, max_tokens=12):
    w = TrainerWorker(TrainerConfig(), model_dir, task, device="cpu")
    return rollout(w.actor, w.tokenizer, task.prompts("train")[:groups], n, max_tokens, version=version, seed=seed)


def weights(w):
    return {k: v.detach().clone() for k, v in w.named_weights()}


CONFIGS = {
    "grpo": dict(algorithm="grpo", kl_coef=0.05, entropy_coef=0.01),
    "rloo_seq": dict(algorithm="rloo", loss_agg="seq_mean", kl_coef=0.05, kl_estimator="k1", kl_mode="reward"),
    "ppo": dict(algorithm="ppo", kl_coef=0.02, kl_mode="reward", dual_clip=3.0, clip_high=0.28),
    "grpo_recompute": dict(algorithm="grpo", recompute_old_logprobs=True, kl_coef=0.05, kl_estimator="k1"),
    "ppo_3_epochs": dict(algorithm="ppo", ppo_epochs=3, clip_low=0.1, clip_high=0.1),
    "rfpp": dict(algorithm="reinforce_plus_plus", gamma=0.95, kl_coef=0.05, kl_mode="reward"),
    "rfpp_baseline": dict(algorithm="reinforce_plus_plus_baseline", kl_coef=0.05),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_streaming_microbatches_equal_one_batch(model_dir, task, name):
    samples, prompts, groups = make_samples(model_dir, task)
    results = []
    for budget, chunk in ((10**6, len(samples)), (40, 1)):
        # adam_eps=1: the update is ~linear in the gradient, so summation-order noise on
        # near-zero gradients is not blown up to +-lr by Adam's normalisation
        w = TrainerWorker(TrainerConfig(lr=1e-2, adam_eps=1.0, max_tokens_per_microbatch=budget, **CONFIGS[name]),
                          model_dir, task, device="cpu")
        before = weights(w)
        order = list(samples)
        if chunk == 1:
            random.Random(0).shuffle(order)
        w.begin_iteration(0, prompts, groups)
        for i in range(0, len(order), chunk):
            w.receive(order[i:i + chunk])
        # small budget: micro-batches trained during receive, unless PPO whitens (all at step())
        assert w._trained_any == (chunk == 1 and not w.cfg.whiten)
        res = w.step()
        assert isinstance(res, StepResult) and res.version == 1 == w.version
        assert res.num_samples == len(samples) and res.num_tokens == sum(len(s.output_ids) for s in samples)
        assert res.metrics["step_skipped"] == 0 and math.isfinite(res.metrics["grad_norm"])
        assert res.metrics["updates"] == CONFIGS[name].get("ppo_epochs", 1)
        results.append((weights(w), res))
    (wa, ra), (wb, rb) = results
    assert any(not torch.equal(wa[k], before[k]) for k in wa)  # the step did something
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6, rtol=1e-5), k
    assert ("kl" in ra.metrics) == ("kl" in rb.metrics) == (CONFIGS[name].get("kl_coef", 0) > 0)  # a reference
    for k in ("reward_mean", "pg_loss", "kl", "entropy"):
        if k in ra.metrics:
            assert ra.metrics[k] == pytest.approx(rb.metrics[k], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_checkpoint_resume_is_bit_identical(model_dir, task, tmp_path, algorithm):
    cfg = TrainerConfig(algorithm=algorithm, lr=1e-2, warmup_steps=2, lr_schedule="cosine", total_steps=5)
    s0, p0, g0 = make_samples(model_dir, task, groups=2, n=2, seed=1)
    s1, p1, g1 = make_samples(model_dir, task, groups=2, n=2, seed=2, version=1)
    a = TrainerWorker(cfg, model_dir, task, device="cpu")
    a.begin_iteration(0, p0, g0)
    a.receive(s0)
    a.step()
    a.save_checkpoint(str(tmp_path / "ckpt"))
    a.save_checkpoint(str(tmp_path / "ckpt"))  # overwriting is atomic too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (tmp_path / "ckpt" / "model" / "tokenizer.json").exists()
    a.begin_iteration(1, p1, g1)
    a.receive(s1)
    ra = a.step()
    b = TrainerWorker(cfg, model_dir, task, device="cpu")
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.version == 1
    b.begin_iteration(1, p1, g1)
    b.receive(s1)
    rb = b.step()
    assert ra.version == rb.version == 2 and ra.metrics["lr"] == rb.metrics["lr"]
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    if algorithm == "ppo":
        assert all(torch.equal(x, y) for x, y in zip(a.critic.parameters(), b.critic.parameters()))
    with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
        b.load_checkpoint(str(tmp_path))


def test_a_longer_schedule_on_resume_takes_its_own_lr(model_dir, task, tmp_path):
    """A finished cosine run continued with more iterations (total_steps follows them) resumes at
    the new schedule's lr for that step, not the old one's last (0)."""
    from workers.trainer.schedule import lr_lambda

    short = TrainerConfig(lr=1e-2, lr_schedule="cosine", total_steps=2)
    s0, p0, g0 = make_samples(model_dir, task, groups=2, n=2, seed=1)
    a = TrainerWorker(short, model_dir, task, device="cpu")
    for it in range(2):
        a.begin_iteration(it, p0, g0)
        a.receive(s0)
        a.step()
    assert a.scheduler.get_last_lr()[0] == 0.0  # the end of a 2-step cosine
    a.save_checkpoint(str(tmp_path / "ckpt"))
    longer = TrainerConfig(lr=1e-2, lr_schedule="cosine", total_steps=6)
    b = TrainerWorker(longer, model_dir, task, device="cpu")
    b.load_checkpoint(str(tmp_path / "ckpt"))
    assert b.scheduler.get_last_lr()[0] == pytest.approx(1e-2 * lr_lambda(longer)(2)) and lr_lambda(longer)(2) > 0.5


def test_streams_from_native_engine_and_loads_weights_back(model_dir, task):
    """Engine samples go straight into receive() as they finish; the engine's log-probs equal the
    trainer's (ratio 1 on the first step); the new weights load into the engine by name."""
    from workers.generation import factory
    from workers.generation.config import EngineConfig
    from workers.generation.generate_all import generate_all
    from workers.types import Request, SamplingParams

    w = TrainerWorker(TrainerConfig(algorithm="grpo", lr=1e-2, max_tokens_per_microbatch=64), model_dir, task,
                      device="cpu")
    eng = factory.make_engine(EngineConfig(max_batch_size=8, kv_cache_tokens=2048, device="cpu", dtype="float32"),
                              model_dir, eos_ids=w.tokenizer.eos_id)
    items = task.prompts("train")[:3]
    for version in (0, 1):
        reqs, prompts = [], {}
        for g, item in enumerate(items):
            ids = torch.tensor(w.tokenizer.encode(w.tokenizer.format_prompt(item.prompt)))
            for j in range(2):
                sid = g * 2 + j
                prompts[sid] = item
                reqs.append(Request(sample_id=sid, prompt_ids=ids, max_tokens=10, group_id=g,
                                    sampling=SamplingParams(temperature=1.0, seed=100 * version + sid)))
        w.begin_iteration(version, prompts, {g: 2 for g in range(len(items))})
        samples = generate_all(eng, reqs, on_sample=lambda s: w.receive([s]))
        assert all(s.weight_version == version and s.finish_reason != "error" for s in samples)
        res = w.step()
        assert res.num_samples == 6 and res.metrics["skipped_samples"] == 0
        if version == 0:
            assert res.metrics["ratio"] == pytest.approx(1.0, abs=1e-4)
        eng.load_weights(w.named_weights(), w.version)
    assert w.version == 2 and eng.stats().weight_version == 2


def test_concurrent_receive_from_threads(model_dir, task):
    """RPC serves calls from a thread pool: concurrent receive() calls give the same update."""
    import threading

    samples, prompts, groups = make_samples(model_dir, task)
    out = []
    for threaded in (False, True):
        w = TrainerWorker(TrainerConfig(lr=1e-2, adam_eps=1.0, max_tokens_per_microbatch=40), model_dir, task,
                          device="cpu")
        w.begin_iteration(0, prompts, groups)
        if threaded:
            ts = [threading.Thread(target=lambda k=k: [w.receive([s]) for s in samples if s.group_id % 2 == k])
                  for k in (0, 1)]
            [t.start() for t in ts]
            [t.join() for t in ts]
        else:
            w.receive(samples)
        assert w.step().num_samples == len(samples)
        out.append(weights(w))
    assert all(torch.allclose(out[0][k], out[1][k], atol=1e-6, rtol=1e-5) for k in out[0])


def test_bf16_autocast_keeps_fp32_master_weights(model_dir, task):
    """The mixed-precision path (bf16 autocast, fp32 masters) as CUDA runs it, here on the CPU's
    bf16 autocast; the CUDA device itself is not available to the tests. Compared with the same
    two steps in fp32. Tolerances are ~3x the largest difference measured over 8 sample/config
    seeds (bf16 rounds to 2^-9 relative, so ~3e-3 relative differences are expected)."""
    samples, prompts, groups = make_samples(model_dir, task)
    later, _, _ = make_samples(model_dir, task, seed=100, version=1)
    # adam_eps=1 makes the update ~lr * grad (linear, as in the streaming test), so the two runs'
    # updates can be compared element-wise; lr=1 makes it large enough (<= ~0.035 per element)
    # that the second step's KL to the reference is well away from zero.
    # kl_coef: a reference to compare (1e-9: the update is as without the KL loss)
    cfg = dict(algorithm="ppo", lr=1.0, adam_eps=1.0, kl_coef=1e-9)
    w = TrainerWorker(TrainerConfig(precision="bf16", **cfg), model_dir, task, device="cpu")
    # the reference's linears in bf16 (what autocast computes with), embeddings and norms fp32: it
    # was loaded whole in bf16, a bf16 residual stream, another model (KL 3e-5 at init; s51)
    dtypes = {n: p.dtype for n, p in w.ref.named_parameters()}
    assert w.bf16 and dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == torch.float32
    fp32 = TrainerWorker(TrainerConfig(precision="fp32", **cfg), model_dir, task, device="cpu")
    assert not fp32.bf16
    before = weights(fp32)
    assert all(torch.equal(before[k], v) for k, v in weights(w).items())
    steps = []
    for it, batch in enumerate((samples, later)):
        for x in (w, fp32):
            x.begin_iteration(it, prompts, groups)
            x.receive(batch)
        steps.append((w.step(), fp32.step()))
        if it == 0:
            wb, wf = weights(w), weights(fp32)
    (res, ref), (res2, ref2) = steps
    assert res.version == ref.version == 1 and res.metrics["step_skipped"] == ref.metrics["step_skipped"] == 0
    assert res2.version == 2 and res2.metrics["step_skipped"] == 0
    # step 1: the actor IS the reference, so KL is exactly 0 in fp32 and in bf16
    assert ref.metrics["kl"] == 0.0 and res.metrics["kl"] == 0.0
    assert res.metrics["entropy"] == pytest.approx(ref.metrics["entropy"], rel=1e-6, abs=0)  # measured <= 3e-7
    assert res.metrics["grad_norm"] == pytest.approx(ref.metrics["grad_norm"], rel=1e-3, abs=0)  # <= 3.5e-4
    assert res.metrics["critic_grad_norm"] == pytest.approx(ref.metrics["critic_grad_norm"], rel=5e-3,
                                                          abs=0)  # <= 1.7e-3
    # the update: fp32 masters in the bf16 run (dtype, and values not rounded to bf16: a bf16
    # master would make every element bf16-representable; measured <= 0.02% are)
    assert all(v.dtype == torch.float32 for v in wb.values())
    assert all(p.dtype == torch.float32 for p in w.actor.parameters())
    assert all(p.dtype == torch.float32 for p in w.critic.parameters())
    flat = torch.cat([v.flatten() for v in wb.values()])
    assert (flat == flat.bfloat16().float()).float().mean().item() < 0.01
    upd_b = {k: wb[k] - before[k] for k in before}
    upd_f = {k: wf[k] - before[k] for k in before}
    for k in before:  # every tensor moved, and the same way (per tensor measured <= 1.9% relative)
        assert upd_f[k].norm() > 0, k
        assert (upd_b[k] - upd_f[k]).norm() <= 0.05 * upd_f[k].norm(), k
    ub, uf = torch.cat([u.flatten() for u in upd_b.values()]), torch.cat([u.flatten() for u in upd_f.values()])
    assert (ub - uf).norm() <= 1e-2 * uf.norm()  # measured 0.30-0.32%
    assert w.ref.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16  # frozen: its linears stay bf16
    # step 2: the actor has moved, so KL is no longer ~0 (fp32: 4.5e-4..1.6e-3 measured)
    assert ref2.metrics["kl"] > 1e-4
    assert res2.metrics["kl"] == pytest.approx(ref2.metrics["kl"], rel=2e-2, abs=0)  # measured <= 5.8e-3
    assert res2.metrics["entropy"] == pytest.approx(ref2.metrics["entropy"], rel=2e-6, abs=0)  # <= 5.2e-7
    assert res2.metrics["grad_norm"] == pytest.approx(ref2.metrics["grad_norm"], rel=1e-3, abs=0)  # <= 3.5e-4


def test_bootstrap_says_when_the_bpe_learns_fewer_tokens_than_asked(tmp_path, capsys):
    """model.init's vocab_size is an upper bound: a small task's texts hold fewer merges, and
    the model is built with the tokenizer's size (the quickstart asks 384 and gets 266)."""
    import json

    task = make_task("synthetic", max_terms=3, num_train=64, num_test=16)
    folder, _ = build_model_dir(tmp_path / "m", task, TINY, seed=0)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert vocab < 300
    assert (f"[bootstrap] the BPE learned {vocab} tokens of the 300 asked (model.init's vocab_size)"
            in capsys.readouterr().err)



def test_a_later_epoch_divides_by_the_micro_batches_it_kept(model_dir, task, monkeypatch):
    """ppo_epochs re-runs the iteration's micro-batches; one whose loss is not finite in a later
    epoch is skipped, and that epoch's update divides by what it kept, not by the first's counts."""
    from workers.trainer import updates

    samples, prompts, groups = make_samples(model_dir, task)
    w = TrainerWorker(TrainerConfig(algorithm="grpo", ppo_epochs=2, max_tokens_per_microbatch=40), model_dir, task,
                      device="cpu")
    divisors, real = [], updates.update
    monkeypatch.setattr(updates, "update", lambda w, params, d: divisors.append(d) or real(w, params, d))
    accumulate, dropped = w.accumulate, []

    def second_epoch_drops_the_first(items, log_stats, later=False):
        if not log_stats and not dropped:
            dropped.append(sum(len(p.output_ids) for p in items))
            return None  # as a non-finite loss: no backward, no counts
        return accumulate(items, log_stats, later)

    monkeypatch.setattr(w, "accumulate", second_epoch_drops_the_first)
    w.begin_iteration(0, prompts, groups)
    w.receive(samples)
    res = w.step()
    tokens = sum(len(s.output_ids) for s in samples)
    assert res.metrics["updates"] == 2 and len(w.trained_batches) == 0 and dropped
    assert divisors == [tokens, tokens - dropped[0]]  # token_mean: the tokens each epoch trained on
