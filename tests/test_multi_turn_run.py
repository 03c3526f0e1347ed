"""A multi-turn run end to end (torchrun: controller, native engine, trainer ranks): the
environment's observations are spliced into the responses on the generation instance, and the
trainer trains the policy's turns only.

The tiny model is random, so its turns would almost never end in EOS (which is what hands a turn
to the environment): its folder's generation_config.json lists half the vocabulary as EOS ids,
so every turn ends within a few tokens."""
import json
import shutil

from tests.runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401

ENV = '''
def env(task, messages):
    assert messages[0]["role"] == "user" and task.prompt in messages[0]["content"]
    turns = sum(m["role"] == "assistant" for m in messages)
    return "result: 7" if turns == 1 else None
'''


def _stops_often(src: str, dst) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos + list(range(10, 160))}))
    return str(dst)


def _two_iterations(tmp_path, tiny_model, env: str):  # noqa: F811
    """A 2-iteration run (eval after the last) with ``env`` as its environment: (torchrun's
    process, the iteration rows)."""
    model = _stops_often(tiny_model, tmp_path / "model")
    (tmp_path / "env.py").write_text(env)
    cfg = write_config(tmp_path, model, train__iterations=2, train__max_tokens=16, train__eval_every=2,
                       multi_turn__env=f"{tmp_path / 'env.py'}:env", multi_turn__max_turns=3)
    p = torchrun(cfg, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1]
    return p, rows


def test_a_multi_turn_run_trains_on_two_turn_responses(tmp_path, tiny_model):  # noqa: F811
    _, rows = _two_iterations(tmp_path, tiny_model, ENV)
    for r in rows:
        m = r["metrics"]
        assert r["num_samples"] == 4 * 2
        # every first turn ends in EOS (p ~ 1 - 2^-16), the environment answers it, and ends the
        # conversation after the second
        assert m["turns_mean"] == 2.0
        assert m["observation_tokens_mean"] > 0
    evals = [json.loads(ln) for ln in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert evals, "the evaluation runs the same turn loop"
    assert all(1.0 <= e["eval/num_turns/mean"] <= 3.0 for e in evals), evals  # verl's val-aux/num_turns


# every turn in one line, each user or tool turn marked with the template variable ``tag``
TAGGED = ("{% for m in messages %}{% if m['role'] in ['user', 'tool'] %}[{{ tag }}] {{ m['content'] }}\n"
          "{% elif m['role'] == 'assistant' %}{{ m['content'] }}\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}A:{% endif %}")


def test_the_engines_render_observations_with_the_prompts_template_and_its_variables(tmp_path, tiny_model):  # noqa: F811
    """tokenizer.chat_template_kwargs (verl's apply_chat_template_kwargs) reach every rendering:
    the controller's prompts and the generation instances' observations, which render with the
    controller's tokenizer (the instances loaded the folder's own before, without the run's tools
    or variables)."""
    model = _stops_often(tiny_model, tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text(TAGGED)
    (tmp_path / "env.py").write_text(ENV)
    dumps = tmp_path / "rollouts"
    cfg = write_config(tmp_path, model, train__iterations=1, train__max_tokens=48, train__eval_every=0,
                       multi_turn__env=f"{tmp_path / 'env.py'}:env", multi_turn__max_turns=3,
                       tokenizer__chat_template_kwargs={"tag": "ZQ"}, logging__rollout_data_dir=str(dumps))
    p = torchrun(cfg, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(ln) for ln in (dumps / "0.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for r in rows:
        assert r["input"].startswith("[ZQ] ") and r["input"].endswith("\nA:"), r["input"]
        assert "[ZQ] result: 7\nA:" in r["output"], r["output"]  # the observation, as the template renders it


FLAKY_ENV = '''
import itertools
import threading

_calls, _lock = itertools.count(1), threading.Lock()


def env(task, messages):
    with _lock:
        n = next(_calls)
    if n % 3 == 0:  # a tool down every third call
        raise ConnectionError("tool server down")
    return "result: 7" if sum(m["role"] == "assistant" for m in messages) == 1 else None
'''


def test_an_environment_that_fails_costs_its_samples_not_the_run(tmp_path, tiny_model):  # noqa: F811
    """An environment's exception failed the round and stopped the run, and an eval sample's
    failed the evaluation (until session 53): each failed sample is the trainer's to skip
    (``trainer.on_bad_sample: skip``, counted in ``skipped_samples``) and eval leaves it out."""
    p, rows = _two_iterations(tmp_path, tiny_model, FLAKY_ENV)
    skipped = sum(r["metrics"]["skipped_samples"] for r in rows)  # (num_samples: those scored)
    assert skipped >= 2 and all(r["num_samples"] + r["metrics"]["skipped_samples"] == 8 for r in rows), rows
    assert "ConnectionError: tool server down" in p.stderr  # said (once per kind)
    assert all(r["batch"]["response_len_min"] > 0 for r in rows)  # a failed sample is no 0-token answer
    # (the greedy eval's turns rarely end in EOS here: its failures are tests/test_val_metrics.py's)
    assert (tmp_path / "run" / "eval.jsonl").read_text()
