"""Over-long prompts are found before the first iteration (not as a crash in iteration N):
one config error naming the prompt, or dropped with ``train.overlong_prompts: skip``."""
import json

import pytest

from controller.config import ConfigError, load_config
from controller.prompt_check import FittingTask
from controller.prompt_fit import ContextNeed, ContextTooSmall, PromptTooLong, fitting_prompts
from tests.runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401
from workers.types import TaskPrompt

ITEMS = [TaskPrompt("a " * n, "x", "t") for n in (3, 9, 2, 12)]


def test_an_empty_split_is_named_not_taken_for_over_long_prompts():
    for policy in ("error", "skip"):
        with pytest.raises(ValueError, match="the train split is empty"):
            fitting_prompts([], list, 100, "train", policy)


def test_fitting_prompts_error_names_the_prompt_and_skip_drops():
    n_tokens = lambda item: [0] * len(item.prompt.split())  # noqa: E731
    with pytest.raises(PromptTooLong, match=r"task.prompts\('train'\)\[1\] .* is 9 tokens .*\(max_model_len\) is 9"):
        fitting_prompts(ITEMS, n_tokens, 9, "train", "error")
    kept, dropped = fitting_prompts(ITEMS, n_tokens, 9, "test", "skip")
    assert kept == [ITEMS[0], ITEMS[2]] and dropped == [1, 3]
    kept, dropped = fitting_prompts(ITEMS, n_tokens, 13, "train", "error")  # 12 + 1 output token fits
    assert kept == ITEMS and dropped == []
    # verl's max_prompt_length: a shorter limit than the context
    with pytest.raises(PromptTooLong, match=r"\[1\] .* is 9 tokens .*; train.max_prompt_tokens is 8\."):
        fitting_prompts(ITEMS, n_tokens, 100, "train", "error", max_prompt_tokens=8)
    kept, dropped = fitting_prompts(ITEMS, n_tokens, 100, "train", "skip", max_prompt_tokens=3)
    assert kept == [ITEMS[0], ITEMS[2]] and dropped == [1, 3]


def test_the_check_records_what_a_joining_instance_must_hold():
    """The longest kept prompt + train.max_tokens, within the starting context: a joiner with
    less is refused by name (tests/test_scale_out_context.py runs it on real engines)."""
    n_tokens = lambda item: [0] * len(item.prompt.split())  # noqa: E731
    need = ContextNeed(10, 4)
    fitting_prompts(ITEMS, n_tokens, 10, "train", "skip", need=need)  # 12 is dropped: it needs nothing
    fitting_prompts(ITEMS[:1], n_tokens, 10, "test", "skip", need=need)
    assert (need.longest, need.where.split(" ")[0], need.tokens) == (9, "task.prompts('train')[1]", 10)  # 9 + 4 > 10
    need.check(3, 10)
    with pytest.raises(ContextTooSmall, match=r"rank 3 has max_model_len 9, less than the 10 tokens .* "
                                              r"task.prompts\('train'\)\[1\] .* is 9 tokens"):
        need.check(3, 9)
    need = ContextNeed(100, 4)
    fitting_prompts(ITEMS, n_tokens, 100, "train", "error", need=need)
    assert need.tokens == 16  # 12 + 4: a joiner needs no more than that, however large the start context


def test_fitting_task_is_the_task_with_fewer_prompts():
    class Task:
        name = "mine"

        def prompts(self, split):
            return ITEMS

        def score(self, prompt, completion):
            return 0.5

    t = FittingTask(Task(), {"train": ITEMS[:1]})
    assert t.prompts("train") == ITEMS[:1] and t.prompts("test") == ITEMS
    assert t.score(ITEMS[0], "") == 0.5 and t.name == "mine"
    import copy

    assert copy.copy(t).prompts("train") == ITEMS[:1]  # no recursion before __init__ ran


def test_policy_is_validated(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  overlong_prompts: truncate\n")
    with pytest.raises(ConfigError, match="train.overlong_prompts: 'truncate' is not one of"):
        load_config(p)
    p.write_text("train:\n  max_prompt_tokens: -1\n")
    with pytest.raises(ConfigError, match="train.max_prompt_tokens must be an int >= 0"):
        load_config(p)


@pytest.mark.slow  # two torchrun runs (~50 s); the check's logic is covered above, in the default tier
def test_runtime_refuses_then_skips_an_overlong_prompt(tmp_path, tiny_model):  # noqa: F811
    """Real torchrun: prompt 5 of 8 is 6,001 tokens for a 4,080-token context. "error" stops
    before any iteration with exit code 2 and one line naming it; "skip" trains on the others."""
    rows = [{"prompt": f"what is {i}+{i}?", "answer": str(2 * i)} for i in range(8)]
    rows[5]["prompt"] = "x " * 3000
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    common = dict(task__name="jsonl", task__kwargs={"files": str(data)}, train__iterations=2,
                  train__eval_every=1, train__eval_prompts=8)
    r = torchrun(write_config(tmp_path, tiny_model, logging__logdir=str(tmp_path / "err"), **common))
    assert r.returncode != 0
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("config error:")]
    assert len(errors) == 1 and "task.prompts('train')[5]" in errors[0] and "6001 tokens" in errors[0], r.stderr[-3000:]
    assert not (tmp_path / "err" / "iterations.jsonl").exists()
    r = torchrun(write_config(tmp_path, tiny_model, logging__logdir=str(tmp_path / "skip"),
                              train__overlong_prompts="skip", **common))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dropped 1 of 8 train prompts" in r.stderr and "dropped 1 of 8 test prompts" in r.stderr
    assert len(iterations(tmp_path / "skip")) == 2


def test_a_prompt_the_template_cannot_render_is_named_whatever_the_policy():
    def encode(item):
        if item is ITEMS[2]:
            raise RuntimeError("System role not supported")  # what a chat template's raise_exception raises
        return [0] * len(item.prompt.split())

    for policy in ("error", "skip"):
        with pytest.raises(ValueError, match=r"task.prompts\('train'\)\[2\] .*: the prompt template cannot render "
                                             r"it: RuntimeError: System role not supported"):
            fitting_prompts(ITEMS, encode, 100, "train", policy)


def test_a_token_id_outside_the_models_vocabulary_is_named():
    # a tokenizer with tokens the model has no embeddings for (special tokens added by hand)
    encode = lambda item: [5] * (len(item.prompt.split()) - 1) + [264]  # noqa: E731
    with pytest.raises(ValueError, match=r"task.prompts\('test'\)\[0\] .*: token id 264 is outside the model's "
                                         r"vocabulary \(vocab_size 264\)"):
        fitting_prompts(ITEMS, encode, 100, "test", "skip", vocab_size=264)
    assert fitting_prompts(ITEMS, encode, 100, "test", "skip", vocab_size=265)[1] == []


def test_the_error_names_every_limit_the_prompt_passes_and_its_source_line():
    from workers.tasks.rows import WHERE

    items = [TaskPrompt("a " * 12, "x", "t", meta={WHERE: "data/train.jsonl:6", "source": "gsm8k"})]
    encode = lambda item: [0] * 12  # noqa: E731
    with pytest.raises(PromptTooLong, match=r"\[0\] \(data/train.jsonl:6\) .* is 12 tokens with the template; the "
                                            r"engines' context \(max_model_len\) is 10, .*; and train.max_prompt_tokens "
                                            r"is 8\."):
        fitting_prompts(items, encode, 10, "train", "error", max_prompt_tokens=8)


def _start_check(eval_every: int, policy: str, context: int, splits: dict, repl: bool = False):
    """``check_task`` as the runner calls it; the tokenizer a word counter."""
    from types import SimpleNamespace

    from controller.config import TrainSection
    from controller.prompt_check import check_task

    train = TrainSection(eval_every=eval_every, overlong_prompts=policy, max_tokens=8)
    return check_task(SimpleNamespace(prompts=lambda split: splits[split]), train, "t", context,
                      lambda item: [0] * len(item.prompt.split()), repl=repl)


def test_a_repl_runs_test_split_is_checked_as_an_evaluating_runs():
    """A REPL `eval` of a run that evaluates on its own never read the test split unchecked: an
    over-long prompt failed the eval under `skip` (review, session 51). With --repl the split
    is checked at start; one the check refuses is left for an eval to say so."""
    fitting, _ = _start_check(0, "skip", 10, {"train": ITEMS[:1], "test": ITEMS}, repl=True)
    assert [p.prompt for p in fitting.prompts("test")] == [p.prompt for p in ITEMS if len(p.prompt.split()) + 1 <= 10]
    fitting, _ = _start_check(0, "skip", 10, {"train": ITEMS[:1], "test": ITEMS[3:]}, repl=True)  # all over-long
    with pytest.raises(ValueError, match="every test prompt is over-long"):  # said by the eval, not sent unchecked
        fitting.prompts("test")
    fitting, _ = _start_check(0, "error", 10, {"train": ITEMS[:1], "test": ITEMS}, repl=True)
    with pytest.raises(ValueError, match=r"task.prompts\('test'\)\[3\] .* is 12 tokens"):
        fitting.prompts("test")
    fitting, _ = _start_check(0, "skip", 10, {"train": ITEMS[:1], "test": ITEMS}, repl=False)
    assert fitting.prompts("test") == ITEMS  # no REPL, no eval: not read at start


def test_a_test_split_left_empty_by_skip_is_an_error_not_a_silent_empty_eval():
    splits = {"train": ITEMS[:1], "test": ITEMS[3:]}  # the one test prompt, 12 tokens, is over-long
    with pytest.raises(ConfigError, match="every test prompt is over-long .*: train.eval_every would evaluate nothing"):
        _start_check(1, "skip", 10, splits)


def test_a_context_that_cuts_the_longest_prompts_answers_is_said(capsys):
    _start_check(0, "error", 14, {"train": ITEMS})  # 12 + 8 > 14
    assert "the longest kept prompt, task.prompts('train')[3]" in capsys.readouterr().err
    _start_check(0, "error", 20, {"train": ITEMS})  # 12 + 8 fits
    assert "answers stop" not in capsys.readouterr().err


def test_chat_prompts_on_a_tokenizer_without_a_chat_template_are_said_to_be_flattened():
    """transformers refuses apply_chat_template without a template; here the turns are joined
    (roles dropped): said once at start (new-user audit, session 18), nothing otherwise."""
    from controller.prompt_check import chat_without_template_note

    chat = TaskPrompt("What is 2 + 9?", "11", "t", messages=({"role": "system", "content": "Answer with #### N."},
                                                               {"role": "user", "content": "What is 2 + 9?"}))
    note = chat_without_template_note([chat, ITEMS[0], chat], has_chat_template=False)
    assert note.startswith("2 of 3 train prompts are chat messages, but the model folder's tokenizer has no chat "
                           "template") and "roles dropped" in note
    assert chat_without_template_note([chat], has_chat_template=True) is None
    assert chat_without_template_note(ITEMS, has_chat_template=False) is None
