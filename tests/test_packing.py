"""workers/trainer/packing.py: samples packed into one sequence (offsets, response positions),
and the padded attention over them equal to the packed causal one (outputs and gradients)."""
import torch

from workers.model import ModelConfig


def test_packing_and_padded_attention_match_packed_causal():
    from workers.model import CausalAttention, CausalLM, init_weights
    from workers.trainer.packing import PaddedCausalAttention, pack

    torch.manual_seed(0)
    m = init_weights(CausalLM(ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)))
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    outs = [torch.tensor([7, 8]), torch.tensor([9, 10, 11, 12]), torch.tensor([13])]
    b = pack(prompts, outs, torch.device("cpu"))
    assert b.cu == [0, 5, 10, 13] and b.resp_pos.tolist() == [2, 3, 5, 6, 7, 8, 11]
    assert torch.equal(b.ids[b.resp_pos + 1], b.resp_ids) and b.seq_index.tolist() == [0, 0, 1, 1, 1, 1, 2]
    grads = []
    for attn in (CausalAttention(b.cu), PaddedCausalAttention(b.cu, torch.device("cpu"))):
        m.zero_grad()
        h = m(b.ids, b.positions, attn)
        h.pow(2).sum().backward()
        grads.append((h.detach(), m.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-4)
