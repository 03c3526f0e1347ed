"""``train.overlong_prompts: truncate_left / truncate_right / truncate_middle`` (verl's
``data.truncation``): a prompt longer than ``train.max_prompt_tokens`` (with its template) is cut
to it, as verl cuts its ``raw_prompt_ids``, where the controller encodes it, so the engines
generate from and the trainer trains on the same cut ids."""
import json
from types import SimpleNamespace

import pytest

from controller.config import ConfigError, TrainSection, from_dict
from controller.program import Program
from controller.prompt_check import check_task
from controller.prompt_fit import TRUNCATIONS, ContextNeed, PromptTooLong, fit_prompt_ids, fitting_prompts
from runtime_helpers import TASK, iterations, tiny_model, torchrun, write_config  # noqa: F401
from workers.types import TaskPrompt

IDS = list(range(10))
ITEMS = [TaskPrompt("a " * n, "x", "t") for n in (3, 9, 2, 12)]
WORDS = lambda item: list(range(len(item.prompt.split())))  # noqa: E731  (a word counter as the tokenizer)


@pytest.mark.parametrize("policy, n, kept", [
    ("truncate_left", 4, [6, 7, 8, 9]),  # the end: verl's left
    ("truncate_right", 4, [0, 1, 2, 3]),  # the start
    ("truncate_middle", 4, [0, 1, 8, 9]),  # verl: n // 2 from the start, the rest from the end
    ("truncate_middle", 5, [0, 1, 7, 8, 9]),
    ("truncate_middle", 1, [9]),
    ("truncate_left", 10, IDS),  # not longer: as it is
])
def test_each_truncation_keeps_what_verls_does(policy, n, kept):
    assert list(fit_prompt_ids(IDS, policy, n)) == kept
    assert len(TRUNCATIONS[policy](IDS, n)) == n


def test_error_and_skip_leave_the_ids_as_they_are():
    for policy in ("error", "skip"):
        assert fit_prompt_ids(IDS, policy, 4) == IDS


def test_the_start_check_keeps_every_prompt_cut_to_the_limit_and_says_how_many(capsys):
    truncated: list[int] = []
    need = ContextNeed(100, 8)
    kept, dropped = fitting_prompts(ITEMS, WORDS, 100, "train", "truncate_left", 4, need, truncated=truncated)
    assert kept == ITEMS and dropped == [] and truncated == [1, 3]
    assert need.longest == 4  # a joiner holds the cut prompts
    train = TrainSection(overlong_prompts="truncate_middle", max_prompt_tokens=4, max_tokens=8)
    fitting, need = check_task(SimpleNamespace(prompts=lambda split: ITEMS), train, "t", 100, WORDS)
    assert list(fitting.prompts("train")) == ITEMS
    assert ("[controller] train.overlong_prompts truncate_middle: cut 2 of 4 train prompts longer than "
            "train.max_prompt_tokens 4 to their first and last 4 tokens (indices [1, 3])") in capsys.readouterr().err


def test_a_cut_prompt_with_no_room_in_the_context_is_an_error_whatever_the_truncation():
    """Only the max_prompt_tokens limit truncates: a limit at or above the engines' context
    would leave the cut prompt no room for an output token."""
    with pytest.raises(PromptTooLong, match=r"\[1\] .* is 9 tokens with the template, cut to train.max_prompt_tokens 8 "
                                            r"\(truncate_right\), which leaves no room for an output token in the "
                                            r"engines' context \(max_model_len\) of 8. Lower train.max_prompt_tokens "
                                            r"below 8"):
        fitting_prompts(ITEMS, WORDS, 8, "train", "truncate_right", 8)
    with pytest.raises(PromptTooLong, match=r"\[1\] .* is 9 tokens with the template which leaves no room"):
        fitting_prompts(ITEMS, WORDS, 9, "train", "truncate_right", 20)  # under the limit, over the context


def test_a_truncation_needs_a_limit_and_verls_spelling_is_named():
    with pytest.raises(ConfigError, match=r"train.overlong_prompts: truncate_left cuts prompts to "
                                          r"train.max_prompt_tokens, which is 0 \(no limit\); set it"):
        from_dict({"train": {"overlong_prompts": "truncate_left"}})
    assert from_dict({"train": {"overlong_prompts": "truncate_left", "max_prompt_tokens": 48}}).train.truncates
    with pytest.raises(ConfigError, match=r"verl's 'truncation' is train.overlong_prompts: truncate_left / "
                                          r"truncate_right / truncate_middle"):
        from_dict({"train": {"truncation": "left"}})
    with pytest.raises(ConfigError, match=r"train.overlong_prompts: 'left' is not one of"):
        from_dict({"train": {"overlong_prompts": "left", "max_prompt_tokens": 48}})


def test_the_controllers_encoding_is_cut_for_training_evaluation_and_the_ranker_alike():
    """``Program.prompt_ids``: the one place the controller encodes a prompt (a dataset item or a text)."""
    tok = SimpleNamespace(encode_prompt=lambda text, messages=(): list(range(len(text.split()))))
    cases = (("truncate_left", [8, 9, 10, 11]), ("truncate_right", [0, 1, 2, 3]), ("error", list(range(12))))
    for policy, want in cases:
        prog = SimpleNamespace(tok=tok, cfg=SimpleNamespace(train=TrainSection(overlong_prompts=policy,
                                                                               max_prompt_tokens=4)))
        assert Program.prompt_ids(prog, ITEMS[3]).tolist() == want
        assert Program.prompt_ids(prog, ITEMS[3].prompt).tolist() == want


_RECORDING_TASK = '''
import json

from workers.tasks.synthetic import SyntheticTask
from workers.trainer import worker as _worker

_receive = _worker.TrainerWorker.receive


def _recorded(self, samples, *args, **kwargs):  # what the trainer rank trains on
    with open({out!r}, "a") as f:
        for s in samples:
            f.write(json.dumps([self._prompts[s.sample_id].prompt, s.prompt_ids.tolist()]) + "\\n")
    return _receive(self, samples, *args, **kwargs)


_worker.TrainerWorker.receive = _recorded
Recorded = SyntheticTask
'''


def test_a_run_trains_on_the_truncated_prompt_ids(tmp_path, tiny_model):  # noqa: F811
    """Real torchrun: every train prompt (6 to 10 tokens) is over train.max_prompt_tokens 4 and
    cut to its last 4 tokens; the samples the trainer rank receives carry exactly those."""
    from workers.tokenizer import Tokenizer

    out = tmp_path / "received.jsonl"
    module = tmp_path / "recording_task.py"
    module.write_text(_RECORDING_TASK.format(out=str(out)))
    task = {**TASK, "num_train": 8}
    cfg = write_config(tmp_path, tiny_model, task__name=f"{module}:Recorded", task__kwargs=task,
                       train__iterations=2, train__eval_every=0, train__overlong_prompts="truncate_left",
                       train__max_prompt_tokens=4)
    p = torchrun(cfg)
    assert p.returncode == 0, p.stderr[-4000:]
    assert ("[controller] train.overlong_prompts truncate_left: cut 8 of 8 train prompts longer than "
            "train.max_prompt_tokens 4 to their last 4 tokens") in p.stderr, p.stderr[-3000:]
    tok = Tokenizer.load(tiny_model)
    received = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(received) == 2 * 4 * 2  # iterations x batch_prompts x group_size
    for text, ids in received:
        full = tok.encode_prompt(text)
        assert len(full) > 4 and ids == full[-4:], (text, ids, full)
    rows = iterations(tmp_path / "run")
    assert [r["batch/prompt_len_max"] for r in rows] == [4, 4] and all(r["num_samples"] == 8 for r in rows)
