"""One request's K/V never reaches another's output: the torch attention backend gathers every
block-table column of the batch's widest sequence for every sequence (padding points at block
0) and masked them in SDPA only, and a masked slot holding inf / NaN is NaN through the mask
(0 * inf). A request whose K overflowed (fp16, a diverged colocated policy) turned its batch
mates' samples into NaN (review, session 50). The 'cpu' kernel reads each sequence's own
tokens only: checked too."""
import pytest
import torch

from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.model import CausalLM, ModelConfig, init_weights
from workers.types import Request, SamplingParams

V, J, POISON = 97, 5, 7


def _model():
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = init_weights(CausalLM(cfg), seed=0, std=0.2).eval()
    with torch.no_grad():  # only POISON has a component on dim J, whose K overflows to inf
        emb = model.model.embed_tokens.weight
        emb[:, J] = 0.0
        emb[POISON] = 0.0
        emb[POISON, J] = 1.0
        model.model.layers[0].self_attn.k_proj.weight[:, J] = 1e38
    return model


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_request_with_inf_keys_leaves_its_batch_mates_alone(backend):
    torch.set_num_threads(1)
    model = _model()
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(temperature=0.0)
    a = Request(0, torch.cat([torch.tensor([POISON]), torch.randint(8, V, (39,), generator=g)]), 3, 3, sampling=greedy)
    b = Request(1, torch.randint(8, V, (5,), generator=g), 3, 3, sampling=greedy)

    def run(reqs):
        eng = NativeEngine(EngineConfig(attention_backend=backend, max_batch_size=4, kv_cache_tokens=1024,
                                        block_size=16, device="cpu"), model=model)
        return {s.sample_id: s for s in generate_all(eng, reqs)}

    alone, both = run([b])[1], run([a, b])
    assert torch.isfinite(alone.logprobs).all()
    assert both[1].output_ids.tolist() == alone.output_ids.tolist()
    torch.testing.assert_close(both[1].logprobs, alone.logprobs, atol=1e-5, rtol=0)
