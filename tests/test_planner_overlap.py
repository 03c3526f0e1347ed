"""controller/planner/overlap.generate_timer (mutation review, s59): the run's stream window and the model's vocabulary."""
import torch

from workers.generation.config import EngineConfig
from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained


def test_generate_timer_streams_at_the_given_window_and_keeps_ids_in_the_models_vocab(tmp_path, monkeypatch):
    """controller/planner/overlap.py: the timed instance streams with the run's
    ``stream_window_s`` (the measured side of the A/B is the runtime's), and random prompt ids stay
    below the model's vocabulary when ``vocab`` (default 300) is larger (a 64-token model here).
    GenerationInstance is the real class, subclassed only to record its window."""
    import controller.instance as instance
    from controller.planner.overlap import generate_timer

    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=3)
    save_pretrained(init_weights(CausalLM(cfg), seed=1, std=0.2), tmp_path / "m")
    windows = []

    class Recording(instance.GenerationInstance):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            windows.append(self.stream_window_s)

    monkeypatch.setattr(instance, "GenerationInstance", Recording)
    run = generate_timer(EngineConfig(device="cpu", max_batch_size=4), str(tmp_path / "m"), [3, 5], [4, 6],
                         window_s=0.005)  # vocab: its default, 300
    assert windows == [0.005]
    assert run() > 0 and sorted(run.sink.received.values()) == [3, 5]
