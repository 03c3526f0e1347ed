"""Custom reward for configs/example_grpo_jsonl.yaml (verl: custom_reward_function.path/name).

StreamRL calls ``fn(prompt: TaskPrompt, completion: str) -> float``: ``prompt.answer`` is the
row's answer field (verl's ground_truth), ``prompt.meta`` holds every other field of the row
(here ``data_source``). Not verl's ``compute_score(data_source, solution_str, ground_truth,
extra_info)``: a function with that signature raises on every sample, and every sample is
skipped (see docs/migrating_from_verl.md). Return a float, not a dict.
"""
import re


def compute_score(prompt, completion):
    numbers = re.findall(r"-?\d+", completion)
    return 1.0 if numbers and numbers[-1] == prompt.answer.strip() else 0.0
