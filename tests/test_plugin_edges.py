"""Your own parts that break their contract, and SFT inputs that train nothing useful, said at
the first place they can be (review, session 50): a ranker whose predict_log has the wrong
shape, whose fit or load_files returns None; a task's messages that are not chat turns; an
empty prompt packed; SFT steps on a model folder; answers its own verifier scores 0."""
import json
import logging

import numpy as np
import pytest
import torch

import ranker
from controller.config import ConfigError, from_dict
from controller.prompt_check import check_demonstrations, task_prompts
from ranker.base import LogLengthRanker
from workers.tasks import make_task
from workers.trainer.packing import pack
from workers.types import TaskPrompt

PROMPTS = [f"Add {' + '.join(['7'] * k)}." for k in range(1, 9)]
LENGTHS = [4.0 * k for k in range(1, 9)]


class Mine(LogLengthRanker):
    def __init__(self):
        self.w = None

    @property
    def fitted(self):
        return self.w is not None

    @property
    def min_rows(self):
        return 2

    def _x(self, prompts):
        return np.array([[1.0, np.log1p(len(p))] for p in prompts])

    def fit(self, prompts, lengths):
        self.w = np.linalg.lstsq(self._x(prompts), np.log1p(np.asarray(lengths, dtype=float)), rcond=None)[0]
        return self

    def update(self, prompts, lengths):
        return self.fit(prompts, lengths)

    def predict_log(self, prompts):
        return self._x(prompts) @ self.w

    def meta(self):
        return {}

    def save_files(self, folder):
        np.save(folder / "w.npy", self.w)

    @classmethod
    def load_files(cls, folder, meta):
        r = cls()
        r.w = np.load(folder / "w.npy")
        return r


class Column(Mine):
    def predict_log(self, prompts):
        return self._x(prompts) @ self.w[:, None]  # [N, 1]: the least-squares slip


class FitNone(Mine):
    def fit(self, prompts, lengths):
        super().fit(prompts, lengths)


class LoadNone(Mine):
    @classmethod
    def load_files(cls, folder, meta):
        super().load_files(folder, meta)


def test_a_ranker_whose_predictions_are_not_one_number_a_prompt_is_named():
    """A column vector passed fit, save and the bootstrap; the run died on its first batch with
    float() of a list."""
    with pytest.raises(ValueError, match=r"predict_log gave shape \(3, 1\) for 3 prompts"):
        ranker.build(f"{__name__}:Column").fit(PROMPTS, LENGTHS).predict(PROMPTS[:3])
    assert len(ranker.build(f"{__name__}:Mine").fit(PROMPTS, LENGTHS).predict(PROMPTS[:3])) == 3


def test_a_bootstrap_whose_fit_returns_none_says_so():
    from ranker.bootstrap import bootstrap

    with pytest.raises(ValueError, match=r"fit\(\) returned None; it must return the ranker"):
        bootstrap(lambda ps: [4.0 * len(p) for p in ps], PROMPTS, n=8, kind=f"{__name__}:FitNone")


def test_a_load_files_that_returns_none_is_named_not_the_folder(tmp_path):
    ranker.build(f"{__name__}:LoadNone").fit(PROMPTS, LENGTHS).save(tmp_path / "r")
    with pytest.raises(ValueError, match="load_files returned NoneType, not a ranker") as e:
        ranker.load(tmp_path / "r")
    assert "cannot be set" not in str(e.value)


class StringTurns:
    def prompts(self, split):
        return [TaskPrompt(prompt="", answer="2", task="t", messages=("What is 1 + 1?",))]


def test_messages_that_are_not_chat_turns_are_refused_naming_the_item():
    with pytest.raises(ValueError, match=r"task.prompts\('train'\)\[0\]: messages\[0\] must be a chat turn"):
        task_prompts(StringTurns(), "train")


def test_an_empty_prompt_is_neither_packed_nor_demonstrated():
    """pack() predicted its response's first token from the previous sequence (b = 0: the
    batch's last token); a demonstration with prompt "" passed the check."""
    with pytest.raises(ValueError, match="pack: prompt 0 has no tokens"):
        pack([torch.zeros(0, dtype=torch.long), torch.tensor([1, 2])], [torch.tensor([3]), torch.tensor([4])],
             torch.device("cpu"))

    class Demos:
        def demonstrations(self, split):
            return [(TaskPrompt(prompt="", answer="x", task="t"), "x")]

    with pytest.raises(ConfigError, match=r"demonstrations\('train'\)\[0\]: prompt must be a string with some text"):
        check_demonstrations(Demos(), "mine")


def test_sft_steps_without_model_init_are_refused():
    """On a model folder they were accepted and never ran."""
    with pytest.raises(ConfigError, match="train.sft_steps: 500 SFT steps run only when model.init builds the model"):
        from_dict({"model": {"path": "/m"}, "train": {"sft_steps": 500}})
    from_dict({"model": {"path": "/m", "init": {}}, "train": {"sft_steps": 500}})


def test_answers_the_tasks_own_verifier_scores_zero_are_said(tmp_path, caplog):
    """A bare "7" under the math verifier (which wants \\boxed{7}) scores 0: the warm start taught
    a format worth nothing, without a word."""
    from workers.trainer.sft import _say_if_unrewarded

    rows = [{"prompt": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(1, 6)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    task = make_task("jsonl", files=str(tmp_path / "d.jsonl"), verifier="math")
    pairs = [(item, item.answer) for item in task.prompts("train")]
    with caplog.at_level(logging.WARNING, logger="streamrl.sft"):
        _say_if_unrewarded(task, pairs)
    assert "the SFT demonstrations score 0.0 under the task's own score" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="streamrl.sft"):
        _say_if_unrewarded(task, [(item, f"\\boxed{{{item.answer}}}") for item, _ in pairs])
    assert caplog.text == ""


class TorchOut(Mine):
    def predict_log(self, prompts):
        return torch.as_tensor(self._x(prompts) @ self.w)


def test_a_ranker_may_give_a_tensor_and_take_any_iterable():
    """(The shape check took only numpy arrays, lists and tuples: a torch ranker was refused.)"""
    r = ranker.build(f"{__name__}:TorchOut").fit(PROMPTS, LENGTHS)
    assert r.predict(iter(PROMPTS[:3])) == pytest.approx(ranker.build(f"{__name__}:Mine").fit(PROMPTS, LENGTHS)
                                                         .predict(PROMPTS[:3]))


class NanLog(Mine):
    def predict_log(self, prompts):
        out = super().predict_log(prompts)
        out[0] = np.nan
        return out


def test_a_ranker_whose_estimates_are_not_finite_is_refused():
    with pytest.raises(ValueError, match="predict_log gave values that are not finite for 3 prompts"):
        NanLog().fit(PROMPTS, LENGTHS).predict(PROMPTS[:3])
