"""``trainer.lora_rank`` (``workers/trainer/lora.py``): only the adapters train; the reference is
the base model; the engines get merged weights that compute what the trainer's adapted actor
computes; checkpoints hold a PEFT adapter folder that PEFT itself loads to the same logits, and
resume to the same next update; 2 data-parallel ranks (sharded optimizer too) give 1 rank's."""
import json
from pathlib import Path

import pytest
import torch

from workers.model import load_pretrained
from workers.tasks import make_task
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.bootstrap import build_model_dir
from workers.trainer.rollout import rollout
from workers.weight_sync.localrun import run_local
from tests.runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401
from tests.trainer_helpers import LengthRewardTask, tiny_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _task():
    return LengthRewardTask(make_task("synthetic", max_terms=3, num_train=64, num_test=16))


def _cfg(**kw) -> TrainerConfig:
    base = dict(algorithm="grpo", lr=5e-2, lora_rank=4, lora_alpha=8.0, kl_coef=0.05, max_tokens_per_microbatch=48,
                max_staleness=10)
    return TrainerConfig(**{**base, **kw})


def _iterate(w, data, iterations=1, rank=0, world=1):
    samples, prompts, groups = data
    for it in range(iterations):
        w.begin_iteration(w.version, prompts, groups)
        w.receive([s for s in samples if s.group_id % world == rank])
        res = w.step()
    return res


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = str(build_model_dir(tmp / "m", _task().base, tiny_config(layers=2), seed=0)[0])
    ref = TrainerWorker(TrainerConfig(), model_dir, _task(), device="cpu")
    data = rollout(ref.actor, ref.tokenizer, _task().prompts("train")[:4], 3, 12, seed=5)
    return model_dir, data


def _logits(model, data):
    samples = data[0]
    seqs = [torch.cat([s.prompt_ids, s.output_ids]) for s in samples[:5]]
    with torch.no_grad():
        return model.forward_packed(seqs), seqs


def test_only_the_adapters_train_and_the_engines_get_the_merged_policy(setup, tmp_path):
    model_dir, data = setup
    base = {k: v.clone() for k, v in load_pretrained(model_dir, "cpu", torch.float32).hf_state_dict().items()}
    w = TrainerWorker(_cfg(), model_dir, _task(), device="cpu")
    trained = w.policy_parameters()
    assert {id(p) for p in trained} == {id(p) for p in w.lora.parameters()}
    assert len(trained) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 layers
    assert not any(p.requires_grad for p in w.actor.parameters())
    assert all(torch.equal(v, base[k]) for k, v in w.named_weights())  # B starts at 0: the base model
    res = _iterate(w, data)
    assert res.version == 1 and res.metrics["grad_norm"] > 0
    assert all(torch.equal(v, base[k]) for k, v in w.actor.hf_state_dict().items())  # the base is frozen
    merged = dict(w.named_weights())
    moved = {k for k in merged if not torch.equal(merged[k], base[k])}
    assert moved == {k for k in base if k.endswith(".weight") and k.split(".")[-2] in TARGETS}
    # the merged weights (what weight sync sends) compute the adapted actor's logits
    engine_side = load_pretrained(model_dir, "cpu", torch.float32)
    engine_side.load_state_dict(merged, strict=False)
    got, _ = _logits(engine_side, data)
    want, _ = _logits(w.actor, data)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, _logits(load_pretrained(model_dir, "cpu", torch.float32), data)[0], atol=1e-3)
    # and the reference is the base model, exactly
    with torch.no_grad():
        seqs = _logits(w.actor, data)[1]
        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(len(s)) for s in seqs])
        from workers.model import CausalAttention
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + len(s))
        ref = w.ref.logits(w.ref(ids, pos, CausalAttention(cu)))
    assert torch.equal(ref, _logits(load_pretrained(model_dir, "cpu", torch.float32), data)[0])
    assert w.lora.enabled  # back on after the reference's forward


def test_a_checkpoint_is_a_peft_adapter_and_resumes_to_the_same_update(setup, tmp_path):
    model_dir, data = setup
    w = TrainerWorker(_cfg(), model_dir, _task(), device="cpu")
    _iterate(w, data, 2)
    w.save_checkpoint(str(tmp_path / "ck"))
    adapter = tmp_path / "ck" / "adapter"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert sorted(conf["target_modules"]) == sorted(TARGETS)
    # model/ is the merged model: a plain HF folder with the adapted weights
    exported = load_pretrained(tmp_path / "ck" / "model", "cpu", torch.float32)
    torch.testing.assert_close(_logits(exported, data)[0], _logits(w.actor, data)[0], rtol=1e-5, atol=1e-5)
    # resumed, the next update is the one the saved worker makes
    r = TrainerWorker(_cfg(), model_dir, _task(), device="cpu")
    r.load_checkpoint(str(tmp_path / "ck"))
    assert r.version == 2
    _iterate(w, data)
    _iterate(r, data)
    for (k, a), (_, b) in zip(w.named_weights(), r.named_weights()):
        assert torch.equal(a, b), k
    # another rank, or no LoRA, is refused naming it
    with pytest.raises(ValueError, match="trained with LoRA of rank 4, this run's trainer.lora_rank is 0"):
        TrainerWorker(TrainerConfig(algorithm="grpo"), model_dir, _task(), device="cpu").load_checkpoint(
            str(tmp_path / "ck"))
    with pytest.raises(ValueError, match="trained with LoRA of rank 4, this run's trainer.lora_rank is 8"):
        TrainerWorker(_cfg(lora_rank=8), model_dir, _task(), device="cpu").load_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(ValueError, match=r"adapters of rank 4, alpha 8 on \[.*\]; this run's trainer.lora_rank 4, "
                                         "lora_alpha 16"):
        TrainerWorker(_cfg(lora_alpha=16), model_dir, _task(), device="cpu").load_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(ValueError, match="this run's trainer.lora_rank 4, lora_alpha 8, lora_target_modules "
                                         r"\['q_proj', 'v_proj'\]"):
        TrainerWorker(_cfg(lora_target_modules=("q_proj", "v_proj")), model_dir, _task(), device="cpu"
                      ).load_checkpoint(str(tmp_path / "ck"))
    # a resume onto another base, or onto the checkpoint's own merged model, is refused
    from workers.trainer.checkpoint import check

    spec = (4, 8.0, TARGETS)
    other = build_model_dir(tmp_path / "other", _task().base, tiny_config(layers=2), seed=1)[0]
    for base in (other, tmp_path / "ck" / "model"):
        with pytest.raises(ValueError, match="the adapters were not trained on this run's model.path"):
            check(tmp_path / "ck", base, "grpo", False, *spec)
    check(tmp_path / "ck", model_dir, "grpo", False, *spec)


def test_peft_loads_the_adapter_to_the_same_logits(setup, tmp_path):
    peft = pytest.importorskip("peft", reason="PEFT is the test-only reference of the adapter format")
    transformers = pytest.importorskip("transformers")
    model_dir, data = setup
    w = TrainerWorker(_cfg(), model_dir, _task(), device="cpu")
    _iterate(w, data)
    w.save_checkpoint(str(tmp_path / "ck"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                           attn_implementation="eager")
    hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "ck" / "adapter")).eval()
    want, seqs = _logits(w.actor, data)
    off = 0
    with torch.no_grad():
        for s in seqs:
            torch.testing.assert_close(hf(s[None]).logits[0], want[off:off + len(s)], rtol=1e-4, atol=1e-4)
            off += len(s)


def _dp(rank, world, model_dir, data, shard):
    w = TrainerWorker(_cfg(shard_optimizer=shard), model_dir, _task(), rank=rank, world_size=world, device="cpu")
    _iterate(w, data, 2, rank, world)
    return {k: v.clone() for k, v in w.named_weights()}


def test_two_ranks_train_the_adapters_as_one_rank(setup):
    model_dir, data = setup
    one = TrainerWorker(_cfg(), model_dir, _task(), device="cpu")
    _iterate(one, data, 2)
    want = dict(one.named_weights())
    for shard in (False, True):
        got = run_local(2, _dp, model_dir, data, shard)[0]
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)  # all-reduce sum order


def test_lora_config_is_checked():
    with pytest.raises(ValueError, match="trainer.lora_alpha .* is only used with trainer.lora_rank > 0"):
        TrainerConfig(lora_alpha=32)
    with pytest.raises(ValueError, match="trainer.lora_target_modules: \\('q_proj', 'lm_head'\\)"):
        TrainerConfig(lora_rank=8, lora_target_modules=["q_proj", "lm_head"])
    assert TrainerConfig(lora_rank=8, lora_target_modules=("q_proj", "v_proj")).lora_rank == 8


def test_a_lora_run_trains_and_checkpoints_its_adapter(tmp_path, tiny_model):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, trainer__lora_rank=4, trainer__lr=1e-2, train__iterations=2,
                       train__eval_every=0, pipeline__mode="stream")
    p = torchrun(cfg, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1]
    saved = tmp_path / "run" / "checkpoints" / "iter_000002" / "trainer"
    assert (saved / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((saved / "trainer.json").read_text())["lora_rank"] == 4
    # the engine took the (merged) weights of version 1 and generated the second iteration with
    # them (that merged weights compute the adapted policy: the first test)
    assert [(r["version"], r["gen_version"]) for r in rows] == [(1, 0), (2, 1)]


def test_activation_checkpointing_and_ppo_with_adapters(setup):
    model_dir, data = setup
    plain = TrainerWorker(_cfg(), model_dir, _task(), device="cpu")
    ckpt = TrainerWorker(_cfg(activation_checkpointing=True), model_dir, _task(), device="cpu")
    for w in (plain, ckpt):
        _iterate(w, data)
    for (k, a), (_, b) in zip(plain.named_weights(), ckpt.named_weights()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)
    # PPO: the actor trains its adapters, the critic (a full copy) every parameter
    w = TrainerWorker(_cfg(algorithm="ppo", kl_coef=0.0), model_dir, _task(), device="cpu")
    critic0 = {k: v.clone() for k, v in w.critic.state_dict().items()}
    assert {id(p) for p in w.policy_parameters()} == {id(p) for p in w.lora.parameters()}
    res = _iterate(w, data)
    assert res.version == 1 and res.metrics["critic_grad_norm"] > 0
    assert any(not torch.equal(v, critic0[k]) for k, v in w.critic.state_dict().items())


def test_the_adapters_gradient_is_the_full_gradient_through_them(setup, tmp_path):
    """The chain rule through W + s B A: dL/dB = s G A^T and dL/dA = s B^T G, G = dL/dW the
    gradient a full-parameter trainer takes at the merged weights on the same samples. After
    one update, so that B != 0 and the gradient reaching earlier layers runs through the
    adapters too."""
    model_dir, data = setup
    samples, prompts, groups = data
    lora = TrainerWorker(_cfg(kl_coef=0.0, max_tokens_per_microbatch=4096), model_dir, _task(), device="cpu")
    _iterate(lora, data)
    lora.save_checkpoint(str(tmp_path / "ck"))  # its model/: the merged weights
    full = TrainerWorker(TrainerConfig(algorithm="grpo", max_tokens_per_microbatch=4096, max_staleness=10),
                         str(tmp_path / "ck" / "model"), _task(), device="cpu")
    for w in (full, lora):
        w.begin_iteration(1, prompts, groups)
        w.receive(samples)
        w._train_ready(flush=True)  # the micro-batches' gradient sums, before the step
    params = dict(full.actor.named_parameters())
    s = lora.lora.scale
    for name in lora.lora.layers:
        key = name.replace(".", "__")
        a, b, g = lora.lora.lora_a[key], lora.lora.lora_b[key], params[f"{name}.weight"].grad
        assert float(b.detach().abs().max()) > 0
        torch.testing.assert_close(b.grad, s * g @ a.detach().T, rtol=1e-3, atol=1e-6, msg=name)
        torch.testing.assert_close(a.grad, s * b.detach().T @ g, rtol=1e-3, atol=1e-6, msg=name)


def test_verls_target_modules_is_named_without_the_schedule_note():
    from controller.config import ConfigError, from_dict

    with pytest.raises(ConfigError) as e:
        from_dict({"trainer": {"target_modules": ["q_proj"]}})
    assert "verl's 'target_modules' is trainer.lora_target_modules" in str(e.value)
    # the note on total_steps is for errors about it, not for every unknown key (its list names it)
    assert "follows train.iterations" not in str(e.value)


def test_a_bf16_trainer_keeps_its_frozen_base_in_bf16_with_the_same_results(setup, monkeypatch):
    """precision bf16 (a GPU's default): the base's linear layers are stored in bf16, half the
    bytes, and every forward and update is bit for bit what fp32 storage under the same
    autocast gives (autocast casts those weights to bf16 for the matmul anyway)."""
    from workers.trainer import worker

    model_dir, data = setup
    half = TrainerWorker(_cfg(precision="bf16"), model_dir, _task(), device="cpu")
    with monkeypatch.context() as m:  # the base as the trainer kept it before: fp32
        m.setattr(worker, "store_linears", lambda model, dtype: None)
        wide = TrainerWorker(_cfg(precision="bf16"), model_dir, _task(), device="cpu")
    assert wide.actor.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    lin = half.actor.model.layers[0].mlp.down_proj
    assert lin.weight.dtype == torch.bfloat16 and half.actor.model.embed_tokens.weight.dtype == torch.float32
    size = {w: sum(p.numel() * p.element_size() for p in w.actor.parameters()) for w in (half, wide)}
    assert size[half] < 0.75 * size[wide]
    for w in (half, wide):
        _iterate(w, data, 2)
    for (k, a), (_, b) in zip(half.lora.peft_state_dict().items(), wide.lora.peft_state_dict().items()):
        assert torch.equal(a, b), k  # the same updates
    for (k, a), (_, b) in zip(half.named_weights(), wide.named_weights()):
        # exported: bf16(W) + delta against W + delta, the base's rounding apart
        assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-2, atol=1e-3), k
    with half.autocast(), wide.autocast():
        assert torch.equal(_logits(half.actor, data)[0], _logits(wide.actor, data)[0])
    # and a checkpoint of it resumes (its merged model/ is bf16(W) + delta, not W + delta)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        half.save_checkpoint(d)
        r = TrainerWorker(_cfg(precision="bf16"), model_dir, _task(), device="cpu")
        r.load_checkpoint(d)
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(r.named_weights(), half.named_weights()))


def test_a_resume_onto_a_base_that_differs_in_any_tensor_is_refused(setup, tmp_path):
    """Every shared tensor is compared (was: the first adapted one alone): a base whose q / v
    projections differ (an SFT model that merged PEFT's default adapter), or whose final norm does
    (a layer the adapters never touch), is not the base the adapters were trained on."""
    from safetensors.torch import load_file, save_file

    from workers.trainer.checkpoint import check

    model_dir, data = setup
    w = TrainerWorker(_cfg(), model_dir, _task(), device="cpu")
    _iterate(w, data, 2)
    w.save_checkpoint(str(tmp_path / "ck"))
    spec = (4, 8.0, TARGETS)
    original = load_file(f"{model_dir}/model.safetensors")
    for changed, said in ((("q_proj.weight", "v_proj.weight"), "is not that model's plus the adapters"),
                          (("model.norm.weight",), r"model.norm.weight of .* is not that model's \(off by .*; the adapters do not touch it")):
        other = tmp_path / f"other_{changed[0]}"
        other.mkdir()
        for f in Path(model_dir).iterdir():
            if f.name != "model.safetensors":
                (other / f.name).write_bytes(f.read_bytes())
        sd = {k: v + 0.05 if k.endswith(changed) else v for k, v in original.items()}
        save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"not trained on this run's model.path.*{said}"):
            check(tmp_path / "ck", other, "grpo", False, *spec)
    check(tmp_path / "ck", model_dir, "grpo", False, *spec)


def test_a_target_named_twice_is_one_target_and_resumes(setup, tmp_path):
    model_dir, data = setup
    cfg = _cfg(lora_target_modules=("q_proj", "v_proj", "q_proj"))
    w = TrainerWorker(cfg, model_dir, _task(), device="cpu")
    _iterate(w, data)
    w.save_checkpoint(str(tmp_path / "ck"))
    r = TrainerWorker(cfg, model_dir, _task(), device="cpu")
    r.load_checkpoint(str(tmp_path / "ck"))
    assert r.version == 1 and len(r.lora.layers) == len(w.lora.layers) == 2 * 2  # 2 layers x (q, v)
