"""``trainer.activation_checkpointing`` (verl's ``enable_gradient_checkpointing``): the actor's and
the critic's training forwards keep only each decoder layer's input and recompute the layer in
backward. The gradients and updates equal those without it (packed micro-batches of several
samples, both training attention backends, tied embeddings, the critic's value head, bf16
autocast, ppo_epochs 2), far fewer bytes are kept for backward, and no-grad forwards (reference,
old log-probs, values) never recompute. Data parallel: 2 checkpointing ranks equal 1 rank without."""
import pytest
import torch

from controller.config import ConfigError, from_dict
from workers.config_schema import build_section
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer import critic as critic_module
from workers.trainer import packing
from workers.trainer.packing import CausalAttention, PaddedCausalAttention
from workers.trainer.rollout import rollout
from workers.trainer.step_math import group_advantages, prepare_batch, train_terms
from workers.weight_sync.localrun import run_local
from tests.trainer_helpers import LengthRewardTask, synthetic_task, tiny_config, tiny_model_dir

torch.set_num_threads(1)

TASK = LengthRewardTask(synthetic_task())
BACKENDS = {"packed": lambda b: CausalAttention(b.cu),  # one T x T attention, masked per sequence
            "padded": lambda b: PaddedCausalAttention(b.cu, b.ids.device)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 4 layers, tied embeddings (tiny_config): the tied matrix gets the embedding's and the head's gradient
    return tiny_model_dir(tmp_path_factory, tiny_config(layers=4, hidden=64, heads=4, kv_heads=2))


@pytest.fixture(scope="module")
def data(model_dir):
    """9 samples (3 prompts x 3), 204 prompt + response tokens in all, rewards differing in a group."""
    w = TrainerWorker(TrainerConfig(), model_dir, TASK, device="cpu")
    return rollout(w.actor, w.tokenizer, TASK.prompts("train")[:3], 3, 16, seed=3)


def worker(model_dir, rank: int = 0, world_size: int = 1, **kw) -> TrainerWorker:
    w = TrainerWorker(TrainerConfig(**kw), model_dir, TASK, rank=rank, world_size=world_size, device="cpu")
    if w.critic is not None:  # the value head starts at 0: no gradient would reach the critic's layers
        with torch.no_grad():
            w.critic.value_head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    return w


def prepared(w: TrainerWorker, data) -> list:
    """Receive-time work on every sample, advantages filled (GRPO per group; PPO: GAE)."""
    samples, prompts, groups = data
    w.begin_iteration(0, prompts, groups)
    items = prepare_batch(w, samples)
    if w.cfg.grouped:
        for g in groups:
            group_advantages(w.cfg, [p for p in items if p.group_id == g])
    return items


def layer_calls(model) -> list[bool]:
    """Appends ``torch.is_grad_enabled()`` at each run of the model's first decoder layer: a
    checkpointed layer runs twice per training forward (forward, then again in backward)."""
    calls: list[bool] = []
    model.model.layers[0].register_forward_pre_hook(lambda m, args: calls.append(torch.is_grad_enabled()))
    return calls


def grads(w: TrainerWorker) -> dict[str, torch.Tensor]:
    out = {f"actor.{k}": p.grad.clone() for k, p in w.actor.named_parameters()}
    if w.critic is not None:
        out.update({f"critic.{k}": p.grad.clone() for k, p in w.critic.named_parameters()})
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_microbatch_gradients_equal_without_checkpointing(model_dir, data, algorithm, backend, monkeypatch):
    """One trainer micro-batch (9 packed samples), fp32: the same gradient sums, actor and critic.
    Tolerance 1e-6 (relative and absolute; gradient sums reach ~1e2): the recomputation runs the
    same kernels on the same inputs, and on this CPU the two are bitwise equal."""
    monkeypatch.setattr(packing, "attention_for", BACKENDS[backend])
    monkeypatch.setattr(critic_module, "attention_for", BACKENDS[backend])
    result = {}
    for ckpt in (False, True):
        w = worker(model_dir, algorithm=algorithm, activation_checkpointing=ckpt)
        items = prepared(w, data)
        assert len(items) == 9
        actor_calls = layer_calls(w.actor)
        critic_calls = layer_calls(w.critic) if w.critic is not None else []
        assert w.accumulate(items, log_stats=False) is not None
        result[ckpt] = grads(w), actor_calls, critic_calls
    (off, actor_off, critic_off), (on, actor_on, critic_on) = result[False], result[True]
    assert len(actor_on) == 2 * len(actor_off) == 2  # recomputed in backward
    assert len(critic_on) == 2 * len(critic_off) == (2 if algorithm == "ppo" else 0)
    for k in off:
        torch.testing.assert_close(on[k], off[k], rtol=1e-6, atol=1e-6, msg=lambda m: f"{k}: {m}")
    layer_grads = [g for k, g in off.items() if ".layers." in k]
    assert all(g.abs().max() > 0 for g in layer_grads), "a layer got no gradient: the comparison would be empty"


def saved_bytes(fn, params: set[int]) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs: each distinct storage saved (by an op
    outside a checkpointed layer; inside one, the checkpoint's own hook takes them) counted once,
    at its largest saved view's ``numel * element_size``. ``params``: storages left out
    (parameters are kept anyway)."""
    seen: dict[int, int] = {}

    def pack_hook(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        fn()
    return sum(seen.values())


def param_storages(w: TrainerWorker) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in w._params()}


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_training_forward_keeps_a_fraction_of_the_bytes(model_dir, data, algorithm):
    """The micro-batch's training forward (actor, + critic for PPO) on 4 layers, 9 packed samples
    (T = 204 tokens): without checkpointing each layer keeps ~19 [T, D]-sized tensors' worth for backward
    (norms in fp32, Q/K/V and their rotations, the attention's output, the MLP's [T, 2D]
    gate/up/product); with it one [T, D] input per layer, plus what lies outside the layers (the
    rotary tables, the final norm, the head's [N, V] logits). Measured: 0.124 (GRPO) and
    0.109 (PPO) of the bytes kept without; asserted < 0.2."""
    kept = {}
    for ckpt in (False, True):
        w = worker(model_dir, algorithm=algorithm, activation_checkpointing=ckpt)
        items = prepared(w, data)
        kept[ckpt] = saved_bytes(lambda: train_terms(w, items), param_storages(w))
    ratio = kept[True] / kept[False]
    assert ratio < 0.2, (kept, ratio)


def test_no_grad_forwards_never_recompute(model_dir, data):
    """Receive-time forwards (reference and old log-probs, critic values) run under no_grad: with
    checkpointing on they keep nothing and run each layer once; the reference never checkpoints."""
    w = worker(model_dir, algorithm="ppo", activation_checkpointing=True, recompute_old_logprobs=True,
               kl_coef=0.1)  # a KL coefficient: there is a reference
    assert w.actor.model.checkpoint_layers and w.critic.model.checkpoint_layers
    assert not w.ref.model.checkpoint_layers
    calls = {name: layer_calls(m) for name, m in (("actor", w.actor), ("critic", w.critic), ("ref", w.ref))}
    assert saved_bytes(lambda: prepared(w, data), set()) == 0
    assert calls == {"actor": [False], "critic": [False], "ref": [False]}


def test_config_key_and_verl_name():
    assert TrainerConfig().activation_checkpointing is False
    assert build_section(TrainerConfig, "trainer", {"activation_checkpointing": True}).activation_checkpointing is True
    for bad in ("false", 1, None):  # a string would be truthy: on when the user wrote "false"
        with pytest.raises(ValueError, match=r"trainer.activation_checkpointing: (expected bool, got|is empty)"):
            TrainerConfig(activation_checkpointing=bad)
    assert from_dict({"trainer": {"activation_checkpointing": True}}).trainer.activation_checkpointing is True
    assert from_dict({}).trainer.activation_checkpointing is False
    with pytest.raises(ConfigError, match=r"trainer.activation_checkpointing: expected bool, got str 'yes'"):
        from_dict({"trainer": {"activation_checkpointing": "yes"}})
    with pytest.raises(ConfigError, match=r"trainer.enable_gradient_checkpointing: unknown key; verl's "
                                          r"'enable_gradient_checkpointing' is trainer.activation_checkpointing"):
        from_dict({"trainer": {"enable_gradient_checkpointing": True}})


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_bf16_update_equal_without_checkpointing(model_dir, data, algorithm):
    """``precision: bf16`` (autocast on CPU; the recomputation runs under the same autocast),
    ppo_epochs 2, micro-batches of ~4 packed samples: the same two updates. Tolerance bf16's
    (rtol 1.6e-2, atol 1e-5, on each weight's change: adam_eps 1 keeps the change proportional to
    the gradient, so a last-bit difference cannot flip the sign of a near-zero Adam step);
    measured bitwise equal on this CPU."""
    samples, prompts, groups = data
    result = {}
    for ckpt in (False, True):
        w = worker(model_dir, algorithm=algorithm, activation_checkpointing=ckpt, precision="bf16", ppo_epochs=2,
                   lr=1e-2, adam_eps=1.0, max_tokens_per_microbatch=100)
        assert w.bf16
        named = dict(w.actor.named_parameters())
        if w.critic is not None:
            named.update({f"critic.{k}": p for k, p in w.critic.named_parameters()})
        before = {k: p.detach().clone() for k, p in named.items()}
        calls = {"actor": layer_calls(w.actor), "critic": layer_calls(w.critic) if w.critic is not None else []}
        w.begin_iteration(0, prompts, groups)
        w.receive(samples)
        res = w.step()
        assert res.metrics["updates"] == 2.0 and res.metrics["num_samples"] == 9
        result[ckpt] = {k: p.detach() - before[k] for k, p in named.items()}, calls
    (off, calls_off), (on, calls_on) = result[False], result[True]
    for name in ("actor", "critic"):  # receive-time (no-grad) passes run once, training ones twice
        assert calls_on[name].count(True) == 2 * calls_off[name].count(True), name
        assert calls_on[name].count(False) == calls_off[name].count(False), name
    assert calls_off["actor"].count(True) == 6  # 3 micro-batches x 2 epochs
    assert calls_off["critic"].count(True) == (6 if algorithm == "ppo" else 0)
    for k in off:
        torch.testing.assert_close(on[k], off[k], rtol=1.6e-2, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert max(d.abs().max() for d in off.values()) > 1e-4  # the weights moved


DP_CONFIG = dict(algorithm="ppo", ppo_epochs=2, lr=1e-2, adam_eps=1.0, max_tokens_per_microbatch=100)


def _dp_rank(rank, world, model_dir, data):
    samples, prompts, groups = data
    w = worker(model_dir, rank, world, **DP_CONFIG, activation_checkpointing=True)
    forwards, calls = [], layer_calls(w.critic)
    w.critic.model.register_forward_pre_hook(lambda m, args: forwards.append(torch.is_grad_enabled()))
    w.begin_iteration(0, prompts, groups)
    w.receive([s for s in samples if s.group_id % world == rank])
    w.step()
    assert calls.count(True) == 2 * forwards.count(True) > 0  # each training forward recomputed
    return {**{k: v.clone() for k, v in w.named_weights()},
            **{f"critic.{k}": v.clone() for k, v in w.critic.state_dict().items()}}


def test_two_checkpointing_ranks_equal_one_rank_without(model_dir, data):
    """PPO (critic, advantages whitened over both ranks, gradients all-reduced after backward),
    ppo_epochs 2: 2 gloo ranks with checkpointing, each with its own groups, give the update of
    1 rank without it on all the samples (tolerance as tests/test_trainer_dp.py's: the sums are
    reduced in another order)."""
    two = run_local(2, _dp_rank, model_dir, data)[0]
    one = worker(model_dir, **DP_CONFIG, activation_checkpointing=False)
    samples, prompts, groups = data
    one.begin_iteration(0, prompts, groups)
    one.receive(samples)
    one.step()
    mine = {**dict(one.named_weights()), **{f"critic.{k}": v for k, v in one.critic.state_dict().items()}}
    assert mine.keys() == two.keys()
    for k in mine:
        torch.testing.assert_close(two[k], mine[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
