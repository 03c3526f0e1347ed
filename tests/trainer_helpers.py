"""Shared by the trainer tests: a tiny model folder on the synthetic task, and a task whose
rewards differ inside a group."""
from workers.model import ModelConfig
from workers.tasks import make_task
from workers.trainer.bootstrap import build_model_dir


def tiny_config(layers: int = 1, hidden: int = 32, heads: int = 2, kv_heads: int = 1) -> ModelConfig:
    return ModelConfig(vocab_size=300, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True)


def synthetic_task():
    return make_task("synthetic", max_terms=3, num_train=64, num_test=16)


def tiny_model_dir(tmp_path_factory, cfg: ModelConfig | None = None, **kw) -> str:
    """A model folder built on the synthetic task (``kw``: build_model_dir's, e.g. sft_steps)."""
    folder, _ = build_model_dir(tmp_path_factory.mktemp("m") / "tiny", synthetic_task(), cfg or tiny_config(),
                                seed=0, **kw)
    return str(folder)


class LengthRewardTask:
    """A task whose rewards differ inside a group: (len(completion) % 5) / 4. An untrained model
    scores 0 everywhere on the synthetic task, and equal rewards give zero advantages, so a
    test of an update would compare two models that never moved."""

    def __init__(self, base):
        self.base = base

    def prompts(self, split):
        return self.base.prompts(split)

    def score(self, prompt, completion):
        return (len(completion) % 5) / 4
