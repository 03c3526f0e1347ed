"""Reward for configs/example_multi_turn.yaml: 1 when the response's first calculator call has
the value of the reference call (the row's ``answer``: the tool call a teacher would make), that
is when the tool's result is the reference's value, else 0.

The completion the reward sees is the whole response decoded: the policy's turns and the
observations. The call is evaluated again here rather than its result read from the text:
without a chat template the tool's answer is spliced in against the policy's next turn, with
nothing to tell where the number ends (a right call followed by "." read as "56.", a wrong one
followed by the policy's own "56" read as its result)."""
from workers.tasks.envs.calculator import calculator_env


def compute_score(prompt, completion):
    expected = calculator_env(None, [{"role": "assistant", "content": prompt.answer}])
    got = calculator_env(None, [{"role": "assistant", "content": completion}])
    return 1.0 if got is not None and not got.startswith("Error") and got == expected else 0.0
