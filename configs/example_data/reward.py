"""Custom reward for configs/example_grpo_jsonl.yaml (verl: custom_reward_function.path/name).

StreamRL calls ``fn(prompt: TaskPrompt, completion: str) -> float``: ``prompt.answer`` is the
row's answer field (verl's ground_truth), ``prompt.meta`` holds every other field of the row
(here ``data_source``). verl's ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)`` works as well (recognised by its parameter names).
"""
import re


def compute_score(prompt, completion):
    numbers = re.findall(r"-?\d+", completion)
    return 1.0 if numbers and numbers[-1] == prompt.answer.strip() else 0.0
