"""Reward for configs/example_multi_turn.yaml: 1 when the response's calculator result (the
observation the environment spliced in after the policy's ``</tool_call>``) is the value of the
reference call (the row's ``answer``: the tool call a teacher would make), else 0.

The completion the reward sees is the whole response: the policy's turns and the observations,
decoded (``multi_turn.env: calculator`` answers a call with the value, as text, right after it
when the model has no chat template)."""
import re

from workers.tasks.envs.calculator import TOOL_CALL, calculator_env

RESULT = re.compile(r"</tool_call>\s*(-?[\d.]+)")


def compute_score(prompt, completion):
    expected = calculator_env(None, [{"role": "assistant", "content": prompt.answer}])
    got = RESULT.search(completion)
    return 1.0 if got and TOOL_CALL.search(completion) and got.group(1) == expected else 0.0
