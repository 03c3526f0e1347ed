"""The runtime generate path's time factor over the bare engine loop (planner host term)."""
import pytest
import torch

from controller.planner.host import runtime_generate_factor
from workers.generation.config import EngineConfig
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained


def test_runtime_generate_factor_times_both_paths_on_every_batch(tmp_path):
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=3)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    batches = [([3, 5, 2], [4, 4, 6]), ([1, 6], [5, 3])]
    r = runtime_generate_factor(EngineConfig(device="cpu", max_batch_size=4), str(tmp_path / "m"), batches,
                                window_s=0.0, vocab=64)
    assert len(r["bare_s"]) == len(r["runtime_s"]) == 2
    assert all(x > 0 for x in r["bare_s"] + r["runtime_s"])
    # the runtime path really generated and streamed every request (warm-up batch included),
    # each at its forced length (checked per batch inside; a short stream raises)
    assert r["streamed"] == 3 + 3 + 2
    with pytest.raises(ValueError, match="no batches"):
        runtime_generate_factor(EngineConfig(device="cpu"), str(tmp_path / "m"), [])


def test_generate_timer_runs_the_runtime_path_on_the_given_shapes(tmp_path):
    from controller.planner.host import _Done
    from controller.planner.overlap import generate_timer

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=3)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    run = generate_timer(EngineConfig(device="cpu", max_batch_size=4), str(tmp_path / "m"), [3, 5], [4, 6],
                         window_s=0.0, vocab=64)
    assert run() > 0 and run() > 0  # repeatable: fresh sample ids each call
    assert sorted(run.sink.received.values()) == [3, 3, 5, 5]  # both calls, at the forced out_lens
    run.sink.received.clear()
    with pytest.raises(RuntimeError, match="2 of 2 samples were not streamed"):
        run.sink.receive = lambda samples: _Done()  # a stream that drops everything is caught
        run()
    with pytest.raises(ValueError, match="out_lens"):
        generate_timer(EngineConfig(device="cpu"), str(tmp_path / "m"), [3], [])
