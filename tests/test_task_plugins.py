"""A user's own task and reward function named in the config (``module:attr`` / ``file.py:attr``):
loaded by the controller and the trainer ranks, every failure one error naming the key."""
import json
from types import SimpleNamespace

import pytest

from controller.config import ConfigError, load_config
from controller.stops import RunStopped
from tests.runtime_helpers import iterations, last_json, tiny_model, torchrun, write_config  # noqa: F401
from workers.tasks.plugins import is_plugin
from workers.tasks.registry import make_task
from workers.types import TaskPrompt

USER_TASK = '''
from workers.types import TaskPrompt

class DoubleTask:
    """Prompts "double N"; the reward is 1 when the completion contains 2N."""

    def __init__(self, n: int = 8, bonus: float = 1.0, floor: float = 0.0, raise_for: str = "", where: str = ""):
        self.items = [TaskPrompt(prompt=f"double {i}", answer=str(2 * i), task="double") for i in range(n)]
        self.bonus, self.floor, self.raise_for, self.where = bonus, floor, raise_for, where

    def prompts(self, split):
        return self.items

    def score(self, prompt, completion):
        if self.where:  # the kind of process that scores: a spawned reward process, or a rank itself
            import multiprocessing
            with open(self.where, "a") as f:
                f.write("spawned\\n" if multiprocessing.parent_process() is not None else "rank\\n")
        if prompt.prompt == self.raise_for:
            raise ValueError("a bug in my reward")
        return self.bonus if prompt.answer in completion else self.floor

def not_a_task(**kw):
    return 42

class LogDispatch:
    """A dispatcher of the user's own (dispatch.name): shortest estimate first, round robin; it
    writes how many requests each plan() got to ``log``. ``drop``: a buggy one that loses one."""

    def __init__(self, log: str, cap: int = 64, drop: bool = False):
        self.log, self.cap, self.drop = log, cap, drop

    def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None):
        from controller.scheduling import DispatchPlan

        with open(self.log, "a") as f:
            f.write(f"{len(est_lens)}\\n")
        order = sorted(range(len(est_lens)), key=lambda i: est_lens[i])[int(self.drop):]
        return DispatchPlan([order[k::len(profiles)] for k in range(len(profiles))], [self.cap] * len(profiles), "mine")

NUMBER = 3
'''


@pytest.fixture
def user_file(tmp_path):
    p = tmp_path / "my_tasks.py"
    p.write_text(USER_TASK)
    return p


def test_task_from_a_file_and_from_a_module(user_file, tmp_path, monkeypatch):
    t = make_task(f"{user_file}:DoubleTask", n=3, bonus=0.5)
    assert [i.prompt for i in t.prompts("train")] == ["double 0", "double 1", "double 2"]
    assert t.score(t.prompts("train")[2], "it is 4") == 0.5 and t.score(t.prompts("train")[2], "5") == 0.0
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks.py").write_text(USER_TASK)
    monkeypatch.chdir(tmp_path)  # a dotted module is imported from the current directory, as under torchrun
    monkeypatch.syspath_prepend(str(tmp_path))
    t = make_task("userpkg.tasks:DoubleTask", n=2)
    assert len(t.prompts("test")) == 2
    monkeypatch.chdir(user_file.parent)
    assert len(make_task("my_tasks.py:DoubleTask").prompts("train")) == 8  # a relative file path


@pytest.mark.parametrize("spec, message", [
    ("missing_dir/nope.py:DoubleTask", "task.name: missing_dir/nope.py .* is not a file"),
    ("{file}:Nope", "task.name: .* has no attribute 'Nope'"),
    ("{file}:NUMBER", "task.name: .* is a int, not a class or function"),
    ("{file}:not_a_task", r"task.name: .* built a int without \['prompts', 'score'\]"),
    ("no_such_module_xyz:Task", "task.name: cannot import 'no_such_module_xyz'"),
    ("gsm8k", "task.name: 'gsm8k' is not one of"),
])
def test_bad_task_specs_name_the_key(user_file, spec, message):
    with pytest.raises(ValueError, match=message):
        make_task(spec.format(file=user_file))


def test_a_dataclass_task_loads_from_a_file(tmp_path):
    # dataclasses look the class's module up in sys.modules while building it
    f = tmp_path / "dc_task.py"
    f.write_text("from __future__ import annotations\nfrom dataclasses import dataclass, field\n"
                 "from workers.types import TaskPrompt\n\n@dataclass\nclass Task:\n    n: int = 2\n"
                 "    def prompts(self, split):\n        return [TaskPrompt(f'p{i}', '1', 'dc') for i in range(self.n)]\n"
                 "    def score(self, prompt, completion):\n        return 1.0\n")
    assert len(make_task(f"{f}:Task", n=3).prompts("train")) == 3


def test_a_broken_user_module_is_one_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import numpy\nraise RuntimeError('my bug')\n")
    with pytest.raises(ValueError, match=r"task.name: loading .*broken.py .*RuntimeError: my bug"):
        make_task(f"{bad}:Task")


def test_verifier_plugin_for_file_tasks(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "say hi", "answer": "hi"}) + "\n")
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def shout(prompt, completion):\n    return 1.0 if completion == prompt.answer.upper() else 0.0\n")
    t = make_task("jsonl", files=str(data), verifier=f"{rewards}:shout")
    item = t.prompts("train")[0]
    assert t.score(item, "HI") == 1.0 and t.score(item, "hi") == 0.0
    with pytest.raises(ValueError, match="task.kwargs.verifier: .* has no attribute 'whisper'"):
        make_task("jsonl", files=str(data), verifier=f"{rewards}:whisper")
    with pytest.raises(ValueError, match="task.kwargs.verifier: .fuzzy. is not one of"):
        make_task("jsonl", files=str(data), verifier="fuzzy")
    # the registered names still win over the plugin syntax
    assert make_task("jsonl", files=str(data), verifier="exact").score(item, "hi") == 1.0


def test_plugin_syntax():
    assert is_plugin("a.b:C") and is_plugin("dir/x.py:f") and is_plugin("x:y.z")
    assert not is_plugin("synthetic") and not is_plugin("a b:C") and not is_plugin("x:") and not is_plugin(":x")


def test_config_load_refuses_a_bad_plugin_before_any_work(tmp_path, user_file):
    p = tmp_path / "c.yaml"
    p.write_text(f"task:\n  name: {user_file}:Nope\n")
    with pytest.raises(ConfigError, match="task.name: .* has no attribute 'Nope'"):
        load_config(p)
    p.write_text(f"task:\n  name: {user_file}:DoubleTask\n")
    assert load_config(p).task.name.endswith(":DoubleTask")


def test_a_user_task_trains_end_to_end(tmp_path, tiny_model, user_file):  # noqa: F811
    """Controller and trainer rank each import the user's file (real torchrun, 3 processes):
    the run completes and its rewards are the user's (every completion scores 0.25 here). The
    score raises on one prompt: its samples are skipped in training and left out of eval.
    Scored in reward processes (``reward_pool: processes``, spawned by the trainer rank and by
    the controller for eval): each builds the task from the file itself, which a pickle of it
    could not (a class loaded by path is not importable by name)."""
    plans = tmp_path / "plans.txt"  # and a dispatcher of the user's own, from the same file
    where = tmp_path / "where.txt"
    cfg = write_config(tmp_path, tiny_model, task__name=f"{user_file}:DoubleTask",
                       task__kwargs={"n": 8, "bonus": 0.25, "floor": 0.25, "raise_for": "double 3",
                                     "where": str(where)},
                       train__iterations=2, train__eval_every=1, train__eval_prompts=8,
                       trainer__reward_pool="processes", trainer__reward_workers=2,
                       dispatch__name=f"{user_file}:LogDispatch", dispatch__options={"log": str(plans), "cap": 4})
    r = torchrun(cfg)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert plans.read_text().split() == ["8", "8"]  # each iteration's 4 prompts x group_size 2
    # 2 x 8 training samples and 2 x 8 eval samples, every one scored in a reward process
    assert where.read_text().split() == ["spawned"] * 32
    assert last_json(r.stdout)["iterations"] == 2
    rows = iterations(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert row["metrics"]["reward_mean"] == pytest.approx(0.25), row
    assert sum(row["metrics"].get("skipped_samples", 0) for row in rows) == 2  # "double 3" x group_size 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(tmp_path / "run" / "tb"))
    ea.Reload()
    assert [e.value for e in ea.Scalars("eval/unscored")] == [1.0, 1.0]
    assert all(e.value == pytest.approx(0.25) for e in ea.Scalars("eval/mean"))


@pytest.mark.parametrize("body,said", [
    ("return [{'prompt': 'x', 'answer': '1'}]", r"task.prompts\('train'\)\[0\] is a dict, not a workers.types.TaskPrompt"),
    ("return 'double 1'", r"prompts\('train'\) returned a str; it must return a list of workers.types.TaskPrompt"),
    ("raise KeyError('no such split')", r"prompts\('train'\) raised KeyError: 'no such split'"),
    ("return [TaskPrompt(prompt=' ', answer='1', task='t')]", r"task.prompts\('train'\)\[0\]: prompt must be a string "
                                                            r"with some text, got ' '"),
    ("return [TaskPrompt(prompt='a', answer=1, task='t')]", r"task.prompts\('train'\)\[0\] \('a'...\): answer must be a "
                                                          r"string \(raw_answer holds any other form\), got int"),
    # a plugin-author review: these passed, or were misread, or failed on the trainer rank after the bootstrap
    ("return None", r"prompts\('train'\) returned None; it must return a list of workers.types.TaskPrompt"),
    ("return [TaskPrompt(prompt='a', answer='1', task=None)]", r"task.prompts\('train'\)\[0\] \('a'...\): task must be "
                                                             r"a non-empty string \(the eval group"),
    ("return [TaskPrompt(prompt='a', answer='1', task='t', meta={'check': lambda c: True})]",
     r"task.prompts\('train'\)\[0\] \('a'...\) cannot be pickled, which sending it to the trainer ranks needs"),
])
def test_what_a_user_tasks_prompts_returns_is_checked(body, said):
    # each was a traceback in the controller (or, for an empty prompt, nothing at all)
    from controller.prompt_check import task_prompts

    ns = {"TaskPrompt": TaskPrompt}
    exec(f"class T:\n    def prompts(self, split):\n        {body}\n", ns)
    with pytest.raises(ValueError, match="^" + said):
        task_prompts(ns["T"](), "train")


def test_a_generator_of_prompts_is_taken_once_as_a_list():
    from controller.prompt_check import task_prompts

    class Gen:
        def prompts(self, split):
            return (TaskPrompt(prompt=f"double {i}", answer=str(2 * i), task="d") for i in range(3))

    assert [i.answer for i in task_prompts(Gen(), "train")] == ["0", "2", "4"]


def test_a_task_score_of_another_signature_is_refused_when_the_task_is_built():
    # it raised on every sample, after the bootstrap and the first generation
    from controller.config_types import ConfigError
    from controller.prompt_check import checked_task

    class OneArg:
        def prompts(self, split):
            return [TaskPrompt(prompt="double 1", answer="2", task="d")]

        def score(self, completion):
            return 1.0

    with pytest.raises(ConfigError, match=r"^task \(mine\): score takes \(completion\); it is called as "
                                          r"score\(prompt: TaskPrompt, completion: str\) -> float$"):
        checked_task(OneArg(), "mine", ("train",))
    OneArg.score = lambda self, prompt, completion: 1.0
    assert checked_task(OneArg(), "mine", ("train",))


def test_a_chat_prompt_left_empty_reaches_the_ranker_as_its_last_user_turn():
    # TaskPrompt(prompt="", messages=...) passed the prompt check, then the ranker's bootstrap died with
    # "ValueError: prompt 0 is empty" as a controller traceback (a plugin-author review)
    from workers.types import prompt_text

    chat = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": None})
    assert prompt_text(TaskPrompt(prompt="", answer="4", task="t", messages=chat)) == "2+2?"
    assert prompt_text(TaskPrompt(prompt="", answer="4", task="t", messages=chat[:1])) == "Be brief."
    assert prompt_text(TaskPrompt(prompt="what?", answer="4", task="t", messages=chat)) == "what?"
    parts = ({"role": "user", "content": [{"type": "text", "text": "3+3?"}]},)  # OpenAI's content parts
    assert prompt_text(TaskPrompt(prompt="", answer="6", task="t", messages=parts)) == "3+3?"


def test_a_chat_prompt_without_any_text_is_refused_at_start():
    # empty turns passed the start check; a run with a ranker stopped at the first iteration that
    # drew the item ("prompt 0 is empty" from ranker.predict; review, s54)
    from controller.prompt_check import task_prompts

    empty = TaskPrompt(prompt="", answer="4", task="t", messages=({"role": "system", "content": ""},
                                                                    {"role": "user", "content": " "}))
    ok = TaskPrompt(prompt="", answer="4", task="t", messages=({"role": "user", "content": "2+2?"},))
    with pytest.raises(ValueError, match=r"task.prompts\('train'\)\[1\]: prompt is empty and no turn of its "
                                         "messages has any text"):
        task_prompts(SimpleNamespace(prompts=lambda split: [ok, empty]), "train")


def test_a_tasks_own_sft_demonstrations_are_checked_on_the_controller():
    # (str, str) pairs or an int completion were the trainer rank's traceback, printed twice
    from controller.config_types import ConfigError
    from controller.prompt_check import check_demonstrations

    item = TaskPrompt(prompt="double 1", answer="2", task="d")

    class Demo:
        def __init__(self, pairs):
            self.pairs = pairs

        def demonstrations(self, split):
            return self.pairs

    check_demonstrations(Demo([(item, "2")]), "mine")
    check_demonstrations(object(), "mine")  # none of its own: the SFT imitates the answers
    with pytest.raises(ConfigError, match=r"^task \(mine\): demonstrations\('train'\)\[0\] must be a \(TaskPrompt, "
                                          r"completion text\) pair, got \('double 1', '2'\)"):
        check_demonstrations(Demo([("double 1", "2")]), "mine")
    with pytest.raises(ConfigError, match=r"\[1\] must be a \(TaskPrompt, completion text\) pair"):
        check_demonstrations(Demo([(item, "2"), (item, 2)]), "mine")
    with pytest.raises(ConfigError, match=r"demonstrations\('train'\) is empty"):
        check_demonstrations(Demo([]), "mine")


def test_a_dispatcher_of_your_own_is_built_and_its_plans_checked(user_file, tmp_path):
    # dispatch.name took the built-in names only, though the Dispatcher Protocol is public (a plugin-author review)
    from controller.scheduling import make_dispatcher
    from controller.sgs import default_profile

    log = tmp_path / "plans.txt"
    d = make_dispatcher(f"{user_file}:LogDispatch", log=str(log), cap=4)
    plan = d.plan([30.0, 10.0, 20.0], [default_profile(), default_profile()])
    assert plan.per_instance == [[1, 0], [2]] and plan.batch_caps == [4, 4]
    bad = make_dispatcher(f"{user_file}:LogDispatch", log=str(log), drop=True)
    # a stop of the run (quiet, one line; a REPL stays), not the controller's traceback
    with pytest.raises(RunStopped, match=r"LogDispatch': the plan must place each of the 3 requests once; missing \[1\]"):
        bad.plan([30.0, 10.0, 20.0], [default_profile(), default_profile()])
    broken = make_dispatcher(f"{user_file}:LogDispatch", log=str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(RunStopped, match=r"LogDispatch': plan\(\) raised FileNotFoundError: .*No such file or "
                                         r"directory: .* \(at .*my_tasks.py:\d+ in plan\)$"):
        broken.plan([30.0], [default_profile()])
    with pytest.raises(ValueError, match=r"LogDispatch': .*unexpected keyword argument 'alpha'"):
        make_dispatcher(f"{user_file}:LogDispatch", log=str(log), alpha=1)
    p = tmp_path / "c.yaml"
    p.write_text(f"placement: {{generation: [1], trainer: [2]}}\ndispatch: {{name: '{user_file}:NUMBER'}}\n")
    with pytest.raises(ConfigError, match=r"dispatch.name: '.*:NUMBER' is a int, not a class or function"):
        load_config(p, 3)
    p.write_text("placement: {generation: [1], trainer: [2]}\ndispatch: {name: shortest}\n")
    with pytest.raises(ConfigError, match=r"dispatch.name: 'shortest' is not one of \[.*\], nor module:Name"):
        load_config(p, 3)


@pytest.mark.parametrize("per, said", [
    ([[0.0, 1.0]], r"request indices must be ints; instance 0's list has 0.0 \(float\), 1.0 \(float\)"),
    ([[0], 1], r"the plan's request list for instance 1 is a int, not a list of request indices"),
    ([[0], ["1"]], r"instance 1's list has '1' \(str\)"),
    ([[0, None], []], r"instance 0's list has None \(NoneType\)"),
    ([[0], [True]], r"instance 1's list has True \(bool\)"),
])
def test_a_plan_of_request_indices_that_are_not_ints_is_a_one_line_stop(per, said):
    # 1.0 == 1 passed the count and the SGS then indexed the requests with it; a str or a
    # non-list raised a TypeError, the controller's traceback (a review of checked_plan)
    import numpy as np

    from controller.own_dispatcher import _Checked, checked_plan
    from controller.scheduling import DispatchPlan

    class Mine:
        def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None):
            return DispatchPlan(per, [1] * len(per), "mine")

    with pytest.raises(RunStopped, match=r"dispatcher 'mine': .*" + said):
        _Checked(Mine(), "mine").plan([1.0, 2.0], [None] * len(per))
    ok = DispatchPlan([[np.int64(1)], (0,)], [1, 1], "mine")  # numpy ints and tuples index fine
    assert checked_plan(ok, 2, 2, "mine") is ok


@pytest.mark.parametrize("per, caps, said", [(None, [1], "the plan's per_instance is a NoneType, not a list"),
                                             ([[0, 1]], None, "the plan's batch_caps is a NoneType, not a list")])
def test_a_plan_without_its_lists_is_a_one_line_stop(per, caps, said):
    """``len(None)`` raised a TypeError: the controller's traceback (review, s53)."""
    from controller.own_dispatcher import _Checked, checked_plan
    from controller.scheduling import DispatchPlan

    class Mine:
        def plan(self, est_lens, profiles, true_lens=None, seed=0, prompt_lens=None):
            return DispatchPlan(per, caps, "mine")

    with pytest.raises(RunStopped, match=f"dispatcher 'mine': {said}"):
        _Checked(Mine(), "mine").plan([1.0, 2.0], [None])
    import numpy as np  # numpy's arrays are lists enough (review of the check above)

    caps = checked_plan(DispatchPlan([[0], [1]], np.full(2, 8), "mine"), 2, 2, "mine").batch_caps
    assert caps == [8, 8] and all(type(c) is int for c in caps)
    split = checked_plan(DispatchPlan(np.array_split(np.arange(3), 2), [1, 1], "mine"), 3, 2, "mine")
    assert split.per_instance == [[0, 1], [2]]  # a list of arrays (numpy's uneven split)


@pytest.mark.parametrize("name, options, said", [
    ("skew_paper", {"mixed": True}, "mixed is read only with cost: simulate"),
    ("skew_paper", {"noise": 0.5}, "noise is read only with cost: simulate"),
    ("skew_paper", {"orders": ["fcfs"]}, "orders is read only with cost: simulate"),
    ("skew", {"q_long": 0.8}, "q_long is read only with cost: formula"),
    ("skew", {"mixed": False, "mixed_order": "lpt"}, "mixed_order is read only with mixed: true and cost: simulate"),
    ("skew", {"draws": 16}, "draws is read only with noise > 0"),  # (docs audit: noise 0 draws nothing)
    ("oracle", {"noise": 0.5}, "noise is read only with estimates"),
])
def test_a_dispatcher_option_its_cost_never_reads_is_refused(name, options, said):
    """Accepted, each gave exactly the default plan (review, s53)."""
    from controller.scheduling import make_dispatcher

    with pytest.raises(ValueError, match=f"dispatcher '{name}': {said}"):
        make_dispatcher(name, **options)
    assert make_dispatcher("skew", mixed=False) and make_dispatcher("skew_paper", cost="simulate", mixed=True)
    assert make_dispatcher("skew", q_long=0.9)  # an unread option at its default: harmless
    assert make_dispatcher("skew", cost="formula", mixed=True)  # skew's own default (mixed), not set by hand


def test_a_plugin_that_exits_at_import_is_an_error_naming_it(tmp_path):
    """A script turned into a reward module (argparse's parse_args() at module level) exited the
    trainer with argparse's usage line, naming no plugin (review, s53)."""
    script = tmp_path / "script_reward.py"
    script.write_text("import sys\nsys.exit(2)\n\ndef compute_score(prompt, completion):\n    return 1.0\n")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"task.kwargs.verifier: loading .*script_reward.py .* failed \(SystemExit: 2\)"):
        make_task("jsonl", files=str(data), verifier=f"{script}:compute_score")
    (tmp_path / "exits_mod.py").write_text("raise SystemExit('usage: no')\n")
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match=r"cannot import 'exits_mod' .*SystemExit: usage: no"):
            make_task("jsonl", files=str(data), verifier="exits_mod:compute_score")
    finally:
        sys.path.remove(str(tmp_path))


def test_a_plugin_file_that_failed_to_load_loads_once_fixed(tmp_path):
    """A file whose code raised stayed in sys.modules half run: the same process (a notebook, a
    test session) loading it again once fixed got the broken module (mutation review, s58)."""
    from workers.tasks.plugins import load_plugin

    f = tmp_path / "reward.py"
    f.write_text("raise RuntimeError('not yet')\ndef score(text):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"task\.name: loading .*reward\.py for .* failed \(RuntimeError: not yet\)"):
        load_plugin(f"{f}:score", "task.name")
    f.write_text("def score(text):\n    return 1.0\n")
    assert load_plugin(f"{f}:score", "task.name")("x") == 1.0
