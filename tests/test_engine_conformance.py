"""Every Engine backend behaves the same through make_engine: streaming finished samples,
forced lengths, refusals, in-place weights with versions, batch cap, stats, abort.
The "vllm" case skips (with the reason) when vLLM is not importable. Your own engine
(``engine.backend: module:Name``) runs the same tests with ``STREAMRL_TEST_ENGINE=module:Name``."""
import importlib.util
import os

import pytest
import torch

from workers.generation.config import EngineConfig
from workers.generation.generate_all import generate_all
from workers.generation.factory import BACKENDS, make_engine
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained
from workers.types import Engine, EngineStats, Request, SamplingParams

torch.set_num_threads(1)
V = 128


def _model(seed: int) -> CausalLM:
    # head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ... (not 16)
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=1)
    return init_weights(CausalLM(cfg), seed=seed, std=0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("conf") / "model"
    save_pretrained(_model(0), d)
    return str(d)


# your own engine, checked against the same behaviour: STREAMRL_TEST_ENGINE=my_pkg.mod:MyEngine
# (or path/engine.py:MyEngine) python -m pytest tests/test_engine_conformance.py
@pytest.fixture(params=["native", "vllm", *filter(None, [os.environ.get("STREAMRL_TEST_ENGINE")])])
def backend(request):
    if request.param == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (bash scripts/install_vllm.sh): the vLLM backend is optional")
    return request.param


def make(backend, model_dir, **kw) -> Engine:
    base = dict(backend=backend, max_batch_size=4, block_size=16, kv_cache_tokens=4096,
                device="cpu", dtype="float32")
    base.update(kw)
    return make_engine(EngineConfig(**base), model_dir)


def reqs(n, new=8, seed=0, sampling=None):
    g = torch.Generator().manual_seed(seed)
    return [Request(sample_id=i, prompt_ids=torch.randint(2, V, (3 + 2 * i,), generator=g),
                    max_tokens=new, min_tokens=new, est_len=float(i),
                    sampling=sampling or SamplingParams(temperature=0.0)) for i in range(n)]


def test_registry_has_both_backends():
    assert {"native", "vllm"} <= set(BACKENDS)
    with pytest.raises(ValueError, match="engine.backend"):
        EngineConfig(backend="nope")


def test_streams_forced_lengths_and_stats(backend, model_dir):
    eng = make(backend, model_dir)
    assert isinstance(eng, Engine)
    rs = reqs(6)
    assert eng.add(rs) == [] and eng.has_work()
    got, steps_with_output = [], 0
    while eng.has_work():
        out = eng.step()
        steps_with_output += bool(out)
        got += out
    assert sorted(s.sample_id for s in got) == list(range(6))
    for s in got:
        assert s.finish_reason == "length" and s.output_ids.dtype == torch.int64
        assert len(s.output_ids) == 8 and s.logprobs.shape == (8,) and s.weight_version == 0
        assert (s.logprobs <= 0).all()
    st = eng.stats()
    assert isinstance(st, EngineStats) and st.running == 0 and st.waiting == 0
    # the round's peak KV use stays readable once the engine is idle (vLLM: its scheduler's
    # usage share of the last steps, in blocks), and a new round counts from its own start
    assert 0 < st.kv_blocks_peak <= st.kv_blocks_used + st.kv_blocks_free
    eng.add([Request(100, torch.tensor([1, 2]), 4, 4, sampling=SamplingParams(temperature=0.0))])
    while eng.has_work():
        eng.step()
    assert 0 < eng.stats().kv_blocks_peak < st.kv_blocks_peak


def test_refusals_keep_serving(backend, model_dir):
    eng = make(backend, model_dir)
    bad = [Request(sample_id=50, prompt_ids=torch.tensor([], dtype=torch.int64), max_tokens=3),
           Request(sample_id=51, prompt_ids=torch.tensor([3, V + 5]), max_tokens=3),
           Request(sample_id=52, prompt_ids=torch.tensor([3, 4]), max_tokens=0),
           Request(sample_id=53, prompt_ids=torch.zeros(600, dtype=torch.int64), max_tokens=3)]
    out = generate_all(eng, reqs(2) + bad)
    by_id = {s.sample_id: s for s in out}
    assert [by_id[i].finish_reason for i in (50, 51, 52, 53)] == ["error"] * 4
    assert all(by_id[i].error for i in (50, 51, 52, 53))
    assert by_id[0].finish_reason == by_id[1].finish_reason == "length"


def test_load_weights_versions_and_errors(backend, model_dir, tmp_path):
    eng = make(backend, model_dir)
    new = _model(5)
    eng.load_weights(new.hf_state_dict().items(), version=2)
    got = generate_all(eng, reqs(3))
    save_pretrained(new, tmp_path / "new")
    want = generate_all(make(backend, str(tmp_path / "new")), reqs(3))
    assert [s.output_ids.tolist() for s in got] == [s.output_ids.tolist() for s in want]
    assert all(s.weight_version == 2 for s in got) and eng.stats().weight_version == 2
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.load_weights([("model.norm.weight", torch.ones(3))], version=3)
    assert eng.stats().weight_version == 2


def test_batch_cap(backend, model_dir):
    eng = make(backend, model_dir, max_batch_size=2)
    eng.add(reqs(5))
    peak = 0
    while eng.has_work():
        eng.step()
        peak = max(peak, eng.stats().running)
    assert peak == 2
    eng.set_max_batch_size(3)
    assert eng.stats().max_batch_size == 3


def test_seeded_sampling_reproducible(backend, model_dir):
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=123)
    a = generate_all(make(backend, model_dir), reqs(3, sampling=sp))
    b = generate_all(make(backend, model_dir, max_batch_size=1), reqs(3, sampling=sp))
    assert [s.output_ids.tolist() for s in a] == [s.output_ids.tolist() for s in b]


def _outputs(samples) -> dict[int, list[int]]:
    return {s.sample_id: s.output_ids.tolist() for s in samples}


def _run(eng, max_steps=500) -> list:
    got = []
    for _ in range(max_steps):
        if not eng.has_work():
            return got
        got += eng.step()
    raise AssertionError(f"engine still has work after {max_steps} steps: {eng.stats()}")


def test_abort_queued_and_running(backend, model_dir):
    # batch cap 2: 0 and 1 run, the rest wait (in vLLM's case in the backend's own queue)
    rs = reqs(6)
    eng = make(backend, model_dir, max_batch_size=2)
    assert eng.add(rs) == []
    eng.step()
    eng.step()
    assert eng.abort([1, 4, 99, 4]) == [1, 4]  # unknown and repeated ids are ignored
    got = _outputs(_run(eng))
    keep = [r for r in rs if r.sample_id not in (1, 4)]
    assert got == _outputs(generate_all(make(backend, model_dir, max_batch_size=2), keep))
    assert eng.abort([0, 2]) == []  # finished
    st = eng.stats()
    assert (st.running, st.waiting, st.kv_blocks_used) == (0, 0, 0)


def test_abort_part_of_a_prefix_shared_group(backend, model_dir):
    p = torch.arange(40) % (V - 2) + 2  # 40 tokens: two full 16-token blocks shared
    rs = [Request(sample_id=i, prompt_ids=p, max_tokens=8, min_tokens=8, group_id=7,
                  sampling=SamplingParams(temperature=0.0)) for i in range(4)]
    eng = make(backend, model_dir)
    eng.add(rs)
    for _ in range(3):
        eng.step()
    assert eng.abort([0, 2]) == [0, 2]
    got = _outputs(_run(eng))
    assert got == _outputs(generate_all(make(backend, model_dir), [rs[1], rs[3]]))
    assert eng.stats().kv_blocks_used == 0


def test_abort_everything_then_reuse_the_ids(backend, model_dir):
    eng = make(backend, model_dir, max_batch_size=2)
    eng.add(reqs(5))
    eng.step()
    assert sorted(eng.abort(range(5))) == list(range(5))
    assert not eng.has_work() and eng.step() == []
    st = eng.stats()
    assert (st.running, st.waiting, st.kv_blocks_used) == (0, 0, 0)
    again = reqs(5, seed=1)  # the same sample ids, other prompts
    assert eng.add(again) == []
    got = _outputs(_run(eng))
    assert got == _outputs(generate_all(make(backend, model_dir, max_batch_size=2), again))


def test_temperature_range_is_the_same(backend, model_dir):
    # both backends serve greedy (T < 1e-5) and 0.01 <= T <= 2 (vLLM's range); vLLM raises
    # 0 < T < 0.01 to 0.01 and refuses T > 2, so both are refused everywhere, per request
    eng = make(backend, model_dir)
    temps = {0: 2.5, 1: 1e30, 2: 0.005, 3: 1e-5, 4: 2.0, 5: 0.01}
    rs = [Request(sample_id=i, prompt_ids=torch.tensor([3, 4, 5]), max_tokens=4,
                  sampling=SamplingParams(temperature=t, seed=i)) for i, t in temps.items()]
    out = {s.sample_id: s for s in generate_all(eng, rs)}
    for i in (0, 1, 2, 3):
        assert out[i].finish_reason == "error" and "outside the served range" in out[i].error
    assert out[4].finish_reason == out[5].finish_reason == "length"
    assert not eng.has_work()
    again = generate_all(eng, [Request(sample_id=0, prompt_ids=torch.tensor([3, 4]), max_tokens=2)])
    assert again[0].finish_reason == "length"  # the refused id was not left "in flight"


def test_near_zero_temperature_is_greedy_with_t1_logprobs(backend, model_dir):
    # the trainer takes greedy samples' log-probs at T = 1: 0 < T < 1e-5 must report exactly
    # those (vLLM alone would sample at 0.01 and report log-probs at 0.01)
    greedy = generate_all(make(backend, model_dir), reqs(3))
    tiny = generate_all(make(backend, model_dir), reqs(3, sampling=SamplingParams(temperature=1e-6, seed=3)))
    for g, t in zip(greedy, tiny):
        assert t.output_ids.tolist() == g.output_ids.tolist()
        torch.testing.assert_close(t.logprobs, g.logprobs, atol=1e-5, rtol=0)
    assert min(float(s.logprobs.min()) for s in greedy) < -0.05  # T = 1 log-probs, not ~0


def test_refused_weights_write_nothing_and_keep_samples_in_flight(backend, model_dir):
    eng = make(backend, model_dir)
    rs = reqs(3, new=10)
    assert eng.add(rs) == []
    for _ in range(3):
        eng.step()
    new = list(_model(5).hf_state_dict().items())
    name, t = new[1]
    bad = [(new, "v2"), (new, -1), (new, True),  # a bad version, with valid new weights
           (new[:1] + [(name, torch.empty(t.shape, device="meta"))], 3),  # meta after a good one
           (new[:1] + [(name, t.to(torch.int64))], 3), (new[:1] + [(name, t.bool())], 3),
           (new[:1] + [(name, t.to(torch.complex64))], 3),
           (new[:1] + [(name, torch.full_like(t, float("nan")))], 3),
           # finite in float64, infinite in the engine's dtype (vLLM used to check before the cast)
           (new[:1] + [(name, torch.full(t.shape, 1e300, dtype=torch.float64))], 3),
           (iter([name, t]), 3), (t, 3)]  # not (name, tensor) pairs
    for items, version in bad:
        with pytest.raises(ValueError, match="load_weights: "):
            eng.load_weights(items, version)
        assert eng.stats().weight_version == 0
    got = _run(eng)
    assert all(s.weight_version == 0 for s in got)  # not restarted, old weights throughout
    assert _outputs(got) == _outputs(generate_all(make(backend, model_dir), rs))


def test_type_leniency_refused(backend, model_dir):
    eng = make(backend, model_dir)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1, got True"):
        eng.set_max_batch_size(True)
    assert eng.stats().max_batch_size == 4
    out = generate_all(eng, [Request(sample_id=0, prompt_ids=torch.tensor([True, False]), max_tokens=2)])
    assert out[0].finish_reason == "error" and "1-D integer tensor" in out[0].error


ADMIT = '''
def reverse(request):
    return -request.sample_id

def picky(request):
    if request.sample_id == 1:
        raise KeyError("no key")
    return 0
'''


def test_your_own_admission_key(backend, model_dir, tmp_path):
    # engine.admission: file.py:fn orders both backends the same way (vLLM: the backend's queue);
    # a request the key fails for is admitted last, not lost
    (tmp_path / "admit.py").write_text(ADMIT)
    # both engines stay alive to the end: a vLLM engine collected while another is built tears
    # down the process's vLLM groups under it ("pipeline model parallel group is not initialized")
    first = make(backend, model_dir, max_batch_size=1, admission=f"{tmp_path}/admit.py:reverse")
    order = []
    generate_all(first, reqs(4, new=2), on_sample=lambda s: order.append(s.sample_id))
    assert order == [3, 2, 1, 0]
    second = make(backend, model_dir, max_batch_size=1, admission=f"{tmp_path}/admit.py:picky")
    order = []
    out = generate_all(second, reqs(3, new=2), on_sample=lambda s: order.append(s.sample_id))
    assert order == [0, 2, 1] and all(s.finish_reason == "length" for s in out)
