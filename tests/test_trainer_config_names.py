"""workers/trainer/config_names.trains_at_step (mutation review, s59): whitening makes training wait for the step."""


from workers.trainer import TrainerConfig
from workers.trainer.config_names import trains_at_step


def test_whitened_advantages_make_training_wait_for_the_step():
    """Whitening normalises over the iteration's samples: a whitened algorithm must not train in
    ``receive`` (step_passes.whiten_pass asserts nothing trained yet), and the planner must
    simulate it training at the end (``train_at_end``, the same rule)."""
    assert trains_at_step("ppo", whiten=True) and not trains_at_step("ppo", whiten=False)
    assert TrainerConfig(algorithm="ppo").trains_at_step
    assert TrainerConfig(algorithm="reinforce_plus_plus").trains_at_step
    assert not TrainerConfig(algorithm="ppo", whiten_advantages=False).trains_at_step
    assert not TrainerConfig(algorithm="grpo").trains_at_step
