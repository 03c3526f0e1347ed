"""Trainer behaviour the rest of the suite let through when changed by one line (mutation review,
session 56): a prompt id equal to vocab_size refused, a sample one version newer refused, a
group id clash in extend_iteration refused."""
import pytest
import torch

from tests.trainer_helpers import tiny_config
from workers.trainer import TrainerConfig
from workers.trainer.sample_checks import bad_sample_reason, check_caller
from workers.types import Sample


def _sample(prompt, output, version=0):
    return Sample(sample_id=7, prompt_ids=torch.tensor(prompt), output_ids=torch.tensor(output),
                  logprobs=torch.full((len(output),), -1.0), weight_version=version, finish_reason="stop", group_id=0)


def test_a_prompt_token_equal_to_the_vocabulary_size_is_bad_input():
    """Ids are valid in [0, vocab): a prompt id == vocab_size would index past the embedding."""
    mc, cfg = tiny_config(), TrainerConfig()
    v = mc.vocab_size
    assert bad_sample_reason(_sample([1, v - 1], [2]), 0, cfg, mc) is None
    assert "outside the model's vocabulary" in bad_sample_reason(_sample([1, v], [2]), 0, cfg, mc)
    assert "outside the model's vocabulary" in bad_sample_reason(_sample([1, 2], [v]), 0, cfg, mc)


def test_a_sample_one_version_newer_than_the_trainer_is_a_caller_bug():
    cfg = TrainerConfig()
    check_caller(_sample([1], [2], version=3), {7: None}, {0: 1}, 3, cfg, 0)  # same version: fine
    with pytest.raises(ValueError, match="weight_version 4 is newer than the trainer's 3"):
        check_caller(_sample([1], [2], version=4), {7: None}, {0: 1}, 3, cfg, 0)


def test_an_extension_that_reuses_a_group_id_is_refused():
    """extend_iteration (the group filter's refill): new sample ids in a group id already held
    would overwrite that group's size; refused like a reused sample id."""
    from workers.trainer.sample_checks import check_new_ids

    known_prompts, known_groups = {0: "p0", 1: "p1"}, {0: 2}
    check_new_ids("ext", {2: "p2", 3: "p3"}, {1: 2}, known_prompts, known_groups)  # all new: fine
    with pytest.raises(ValueError, match=r"ext: ids already registered: \[0\]"):
        check_new_ids("ext", {2: "p2", 3: "p3"}, {0: 2}, known_prompts, known_groups)
