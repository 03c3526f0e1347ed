"""Shared by the trainer tests."""


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
