"""NativeEngine.load_weights: weights loaded in place act like a fresh engine (also mid-flight:
in-flight samples restart); a refused update (bad name, shape, version, dtype, meta, inf, a
failing cast) writes nothing and leaves the samples in flight as they were."""
import pytest
import torch
from test_engine import MODEL, PS, check_against_recompute, engine, greedy_requests, tiny_model

from workers.generation.generate_all import generate_all
from workers.types import Request, SamplingParams

torch.set_num_threads(1)


def test_load_weights_like_fresh_engine():
    other = tiny_model(seed=7)
    reqs = greedy_requests(PS[:4], 8)
    eng = engine(model=tiny_model())  # own copy: load_weights writes into the model in place
    generate_all(eng, reqs)
    eng.load_weights(other.hf_state_dict().items(), version=3)
    got = generate_all(eng, reqs)
    want = generate_all(engine(model=other), reqs)
    assert [s.output_ids.tolist() for s in got] == [s.output_ids.tolist() for s in want]
    assert all(s.weight_version == 3 for s in got)


def test_load_weights_mid_flight_restarts_in_flight_samples():
    other = tiny_model(seed=7)
    reqs = [Request(sample_id=i, prompt_ids=PS[2 + i % 2], max_tokens=8, min_tokens=8,
                    sampling=SamplingParams(temperature=1.0, seed=i), group_id=i % 2)  # 2 groups of 2
            for i in range(4)]
    eng = engine(model=tiny_model(), max_batch_size=2)
    eng.add(reqs)
    for _ in range(3):
        assert eng.step() == []
    eng.load_weights(other.hf_state_dict().items(), version=1)
    got = generate_all(eng, [])
    want = generate_all(engine(model=other, max_batch_size=2), reqs)
    assert {s.sample_id: s.output_ids.tolist() for s in got} == {s.sample_id: s.output_ids.tolist() for s in want}
    assert sorted(s.sample_id for s in got) == [0, 1, 2, 3] and all(len(s.output_ids) == 8 for s in got)
    assert all(s.weight_version == 1 for s in got)


def test_load_weights_refuses_bad_tensor_before_touching_anything():
    eng = engine()
    before = {k: v.clone() for k, v in MODEL.hf_state_dict().items()}
    new = [(k, torch.zeros_like(v)) for k, v in before.items()]
    bad_shape = new[:-1] + [(new[-1][0], torch.zeros(3, 3))]
    with pytest.raises(ValueError, match=new[-1][0].replace(".", r"\.")):
        eng.load_weights(bad_shape, version=1)
    with pytest.raises(ValueError, match="model.nope.weight"):
        eng.load_weights(new + [("model.nope.weight", torch.zeros(1))], version=1)
    assert all(torch.equal(before[k], v) for k, v in MODEL.hf_state_dict().items())
    assert eng.weight_version == 0


def test_load_weights_refuses_a_name_given_twice_and_unequal_halves_of_a_tied_matrix():
    # the native engine kept the last of two tensors of one name, vLLM the first (or failed midway);
    # a tied model's embedding and lm_head given different values: native wrote the later, vLLM
    # the embedding (review, s54). Both refused, nothing written
    eng = engine()
    before = {k: v.clone() for k, v in MODEL.hf_state_dict().items()}
    w = before["model.norm.weight"]
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' is given twice"):
        eng.load_weights([("model.norm.weight", w * 2), ("model.norm.weight", w * 3)], version=1)
    from workers.model import ModelConfig, CausalLM, init_weights

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True)
    tied = engine(init_weights(CausalLM(cfg), seed=0))
    e = tied.model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(ValueError, match="one tied matrix in this model and were given different values"):
        tied.load_weights({"model.embed_tokens.weight": e + 1, "lm_head.weight": e + 2}, version=1)
    tied.load_weights({"model.embed_tokens.weight": e + 1, "lm_head.weight": e + 1}, version=1)  # equal: taken
    assert torch.equal(tied.model.lm_head.weight, e + 1)
    assert all(torch.equal(before[k], v) for k, v in MODEL.hf_state_dict().items()) and eng.weight_version == 0


def test_load_weights_refusal_writes_nothing_mid_flight():
    # the version and every tensor are checked before the first write: a refused update leaves
    # the weights, the version and the samples in flight as they were (no mixed versions)
    model = tiny_model()
    eng = engine(model=model)
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    reqs = greedy_requests(PS[:3], 8)
    eng.add(reqs)
    for _ in range(3):
        eng.step()
    new = [(k, v + 1.0) for k, v in before.items()]
    name, t = new[1]
    for items, version in [(new, "v2"), (new, 2.5),
                           (new[:1] + [(name, torch.empty(t.shape, device="meta"))], 1),
                           (new[:1] + [(name, t.to(torch.int64))], 1),
                           (new[:1] + [(name, t.to(torch.complex64))], 1),
                           (new[:1] + [(name, torch.full_like(t, float("inf")))], 1)]:
        with pytest.raises(ValueError, match="load_weights: "):
            eng.load_weights(items, version)
        assert all(torch.equal(before[k], v) for k, v in model.hf_state_dict().items())
        assert eng.weight_version == 0
    got = sorted(generate_all(eng, []), key=lambda s: s.sample_id)
    check_against_recompute(reqs, got, model)
    assert all(s.weight_version == 0 for s in got)


class _CastFails(torch.Tensor):
    """A tensor whose dtype cast raises, standing in for a cast that runs out of memory."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            raise RuntimeError("simulated out of memory in the cast")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_load_weights_casts_everything_before_the_first_write():
    # float64 update into float32 weights: every cast happens before any tensor is written, so
    # one that fails (here: the last one) leaves all the weights and the version as they were
    model = tiny_model()
    eng = engine(model=model)
    before = {k: v.clone() for k, v in model.hf_state_dict().items()}
    new = [(k, (v + 1.0).double()) for k, v in before.items()]
    new[-1] = (new[-1][0], new[-1][1].as_subclass(_CastFails))
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        eng.load_weights(new, version=1)
    assert all(torch.equal(before[k], v) for k, v in model.hf_state_dict().items())
    assert eng.weight_version == 0
