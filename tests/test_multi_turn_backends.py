"""Multi-turn rollouts through ``make_engine`` on every backend (native; vLLM when installed: the
CI's vLLM tier runs this file): a trajectory is turn, observation, turn, and each turn is what
the same backend generates greedily from the whole context so far."""
import importlib.util
import json

import pytest
import torch

from controller.config_sections import MultiTurnSection
from workers.generation.config import EngineConfig
from workers.generation.generate_all import generate_all
from workers.generation.factory import make_engine
from workers.generation.multi_turn import MultiTurnEngine
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained
from workers.tokenizer import train_bpe
from workers.types import Request, SamplingParams

torch.set_num_threads(1)
TEXTS = ["what is the answer to the question", "result: 7 and the tool said so", "the answer is 42"] * 30
TOK = train_bpe(TEXTS, vocab_size=300)
V = TOK.vocab_size
GREEDY = SamplingParams(temperature=0.0)
OBS = "result: 7"
ENV = f'''
def env(task, messages):
    turns = sum(m["role"] == "assistant" for m in messages)
    return {OBS!r} if turns == 1 else None
'''


@pytest.fixture(params=["native", "vllm"])
def backend(request):
    if request.param == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (bash scripts/install_vllm.sh): the vLLM backend is optional")
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=TOK.eos_id)
    d = tmp_path_factory.mktemp("mt") / "model"
    save_pretrained(init_weights(CausalLM(cfg), seed=0, std=0.2), d)
    TOK.save(d)
    return str(d)


def _cfg(backend: str, eos) -> EngineConfig:
    return EngineConfig(backend=backend, max_batch_size=4, block_size=16, kv_cache_tokens=4096, device="cpu",
                        dtype="float32", eos_ids=tuple(eos))


def _greedy(backend, model_dir, prompt: list[int], max_tokens: int, eos) -> list[int]:
    eng = make_engine(_cfg(backend, eos), model_dir)
    try:
        [s] = generate_all(eng, [Request(0, torch.tensor(prompt), max_tokens, sampling=GREEDY)])
    finally:
        eng.close()
    return s.output_ids.tolist()


def test_turn_observation_turn_on_every_backend(backend, model_dir, tmp_path):
    (tmp_path / "env.py").write_text(ENV)
    prompt = TOK.encode("what is the answer")
    # the EOS ids: half the vocabulary, so the random model's turns end within a few tokens
    eos = tuple(range(V // 2, V))
    turn1 = _greedy(backend, model_dir, prompt, 30, eos)
    obs = TOK.encode(OBS)
    turn2 = _greedy(backend, model_dir, prompt + turn1 + obs, 30 - len(turn1) - len(obs), eos)
    assert turn1[-1] in eos and turn2[-1] in eos  # both turns end in EOS
    eng = make_engine(_cfg(backend, eos), model_dir, multi_turn=MultiTurnSection(env=f"{tmp_path}/env.py:env"))
    try:
        assert isinstance(eng, MultiTurnEngine)
        [s] = generate_all(eng, [Request(5, torch.tensor(prompt), 30, sampling=GREEDY, group_id=3)])
    finally:
        eng.close()
    assert s.finish_reason == "stop" and s.turns == 2 and s.sample_id == 5
    assert s.output_ids.tolist() == turn1 + obs + turn2
    assert s.loss_mask.tolist() == [True] * len(turn1) + [False] * len(obs) + [True] * len(turn2)
    assert s.logprobs[len(turn1):len(turn1) + len(obs)].tolist() == [0.0] * len(obs)
    assert bool((s.logprobs[s.loss_mask] <= 0).all())


def test_the_prefix_bench_does_the_same_turns_and_caching_computes_less(capsys, monkeypatch):
    """bench/multi_turn_prefix.py: both runs submit the same turns; with caching each continuation
    computes its observation and at most one partial block of what came before."""
    from tests.bench_loading import load_bench

    out = load_bench("multi_turn_prefix", monkeypatch).main(["--quick", "--prompts", "4", "--threads", "1"])
    runs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"run"' in line]
    on, off = (next(r for r in runs if r["run"] == name) for name in ("caching_on", "caching_off"))
    assert on["submitted_tokens"] == off["submitted_tokens"] and on["turns_mean"] == off["turns_mean"] == 3
    assert off["hit_tokens"] == 0 and off["computed_tokens"] == off["submitted_tokens"]
    # per trajectory: the prompt, then each continuation's observation (64), its own turn and < one block (16)
    assert on["computed_tokens"] <= 4 * (64 + 2 * (64 + 16 + 8))
    assert out["computed_tokens_on"] == on["computed_tokens"] and out["off_over_on"] > 0


def test_the_trainers_log_probs_of_a_multi_turn_sample_are_the_samplers(model_dir, tmp_path):
    """What the trainer recomputes over prompt + every turn and observation (one packed forward,
    as it trains) equals what the sampler returned at each of the policy's tokens: the turns and
    the observations sit where the engine put them."""
    from workers.model import load_pretrained
    from workers.trainer.packing import pack, response_logits, token_logprobs

    (tmp_path / "env.py").write_text(ENV)
    eos = tuple(range(V // 2, V))
    eng = make_engine(_cfg("native", eos), model_dir, multi_turn=MultiTurnSection(env=f"{tmp_path}/env.py:env"))
    prompt = torch.tensor(TOK.encode("what is the answer"))
    out = generate_all(eng, [Request(i, prompt, 30, sampling=SamplingParams(temperature=1.0, seed=i))
                             for i in range(6)])
    assert all(s.turns == 2 for s in out)
    model = load_pretrained(model_dir).eval()
    batch = pack([s.prompt_ids for s in out], [s.output_ids for s in out], torch.device("cpu"), [0] * len(out))
    with torch.no_grad():
        lp = token_logprobs(response_logits(model, batch), batch.resp_ids)
    mask = torch.cat([s.loss_mask for s in out])
    torch.testing.assert_close(lp[mask], torch.cat([s.logprobs for s in out])[mask], atol=1e-4, rtol=0)
