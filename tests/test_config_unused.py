"""Keys a run accepted and never read (controller/config_unused.py; a review, session 51): each is
a config error naming the key and the switch it needs."""
import pytest

from controller.config import ConfigError, from_dict

BASE = {"placement": {"generation": [1], "trainer": [2]}}


@pytest.mark.parametrize("over, said", [
    ({"train": {"length_scale": 0.5}}, "train.length_scale: 0.5 acts only with train.length_trace"),
    ({"train": {"sft_lr": 1e-3}}, "train.sft_lr: 0.001 acts only with model.init"),
    ({"multi_turn": {"max_turns": 2}}, "multi_turn.max_turns: 2 acts only with multi_turn.env"),
    ({"multi_turn": {"observation_truncate_side": "left"}}, "multi_turn.observation_truncate_side: 'left' acts only"),
    ({"ranker": {"bootstrap_prompts": 64}}, "ranker.bootstrap_prompts: 64 acts only with ranker.kind"),
    ({"ranker": {"options": {"rounds": 10}}}, "ranker.options: {'rounds': 10} acts only with ranker.kind"),
    ({"ranker": {"path": "runs/ranker"}}, "ranker.path: 'runs/ranker' acts only with ranker.kind"),  # (review, s55)
    ({"trainer": {"max_response_tokens": -5}}, "trainer.max_response_tokens: -5 differs from the run's response cap"),
    ({"trainer": {"overlong_buffer": 16, "max_response_tokens": 100000}, "train": {"max_tokens": 48}},
     "trainer.max_response_tokens: 100000 differs from the run's response cap train.max_tokens 48"),
    ({"engine": {"seed": 5}}, "engine.seed: 5 is read by nothing in a run: every request carries its own seed"),
    ({"engine": {"admission": "lpt"}}, "engine.admission: lpt admits the longest estimate first, and ranker.kind"),
    ({"dispatch": {"options": {"order": "lpt"}}}, "dispatch.options.order: lpt orders by estimate, and ranker.kind"),
    ({"pipeline": {"mode": "colocated"}, "placement": {"generation": [1], "trainer": [1]},
      "weight_sync": {"bucket_mb": 1.0}}, "weight_sync: colocated, the trainer's weights are copied within each"),
    ({"pipeline": {"mode": "colocated"}, "placement": {"generation": [1], "trainer": [1]},  # (review, s54)
      "topology": {"datacenters": {"a": [0, 1], "b": []}, "shaped_links": ["inter_dc"]}},
     "topology: colocated, the trainer's weights are copied within each process, no broadcast runs over its links"),
])
def test_a_key_whose_switch_is_off_is_refused(over, said):
    with pytest.raises(ConfigError, match=f"^{said}"):
        from_dict({**BASE, **over})


def test_vllm_takes_none_of_the_native_engines_kernel_keys(monkeypatch):
    from workers.generation import support

    monkeypatch.setattr(support, "engine_problem", lambda *a, **k: None)  # (as if vLLM were installed)
    for key, value in (("attention_backend", "torch"), ("cpu_prepack", True), ("cpu_half_compute", "native")):
        with pytest.raises(ConfigError, match=f"^engine.{key}: .* acts only with engine.backend: native"):
            from_dict({**BASE, "engine": {"backend": "vllm", "device": "cpu", key: value}})


def test_your_own_engine_takes_engine_seed_and_the_cli_names_the_default_to_set(tmp_path):
    """docs/config.md: honouring engine.seed is up to your engine (it was refused with every
    backend); a key refused from a file is `--set KEY=<default>` from the command line."""
    from controller.config import load_config

    (tmp_path / "eng.py").write_text("from workers.generation.engine import NativeEngine as Mine\n")
    from_dict({**BASE, "engine": {"backend": f"{tmp_path}/eng.py:Mine", "seed": 5}})
    with pytest.raises(ConfigError, match=r"drop multi_turn.max_turns \(from the command line: --set "
                                          r"multi_turn.max_turns=4\)"):
        load_config("configs/example_multi_turn.yaml", 3, ["multi_turn.env="])


def test_the_same_keys_with_their_switch_on_are_taken():
    from_dict({**BASE, "multi_turn": {"env": "calculator", "max_turns": 2},
               "model": {"init": {"hidden_size": 64}}, "train": {"sft_lr": 1e-3}})
    from_dict({**BASE, "pipeline": {"mode": "colocated"}, "placement": {"generation": [1], "trainer": [1]}})


def test_minibatch_size_outside_the_minibatch_mode_is_refused_but_not_for_a_console():
    """A stream run with pipeline.minibatch_size 3 trained as if it were not there (review, session
    52); with --repl, `mode minibatch` reads it later (controller/main.py skips the check)."""
    from controller.config_unused import minibatch_unused

    with pytest.raises(ConfigError, match=r"^pipeline.minibatch_size: 3 acts only with pipeline.mode: minibatch \(this "
                                          r"run's is stream\); .*--set pipeline.minibatch_size=8\), or run with --repl"):
        minibatch_unused(from_dict({**BASE, "pipeline": {"mode": "stream", "minibatch_size": 3}}))
    minibatch_unused(from_dict({**BASE, "pipeline": {"mode": "minibatch", "minibatch_size": 3}}))
    minibatch_unused(from_dict({**BASE, "pipeline": {"mode": "stream"}}))
