"""The noise-ceiling estimate (ranker/ceiling.py) and its CLI: no noise gives a ceiling of 1,
pure noise gives about what chance gives, and the CLI prints one JSON object."""
from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest

from ranker.ceiling import noise_ceiling, split_half_recall
from ranker.cli import main


def test_steady_answers_give_ceiling_one():
    rng = np.random.default_rng(0)
    base = rng.lognormal(5, 1, size=300)
    answers = np.repeat(base[:, None], 3, axis=1)  # every answer equals its prompt's length
    rep = noise_ceiling(answers, ["t"] * 300, repeats=3)
    assert rep["observed_split_half"] == 1.0
    assert rep["ceiling"] == pytest.approx(1.0)


def test_pure_noise_gives_chance_level():
    rng = np.random.default_rng(1)
    answers = rng.lognormal(5, 1, size=(500, 3))  # prompts differ only by sampling noise
    rep = noise_ceiling(answers, ["a", "b"] * 250, repeats=5)
    assert rep["observed_split_half"] < 0.35
    assert rep["ceiling"] < 0.35, rep
    assert [g["q"] for g in rep["grid"]] == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_ceiling_sits_between_split_half_and_one():
    rng = np.random.default_rng(2)
    loc = rng.normal(5, 1, size=400)
    answers = np.exp(loc[:, None] + rng.normal(0, 0.5, size=(400, 3)))
    rep = noise_ceiling(answers, ["t"] * 400, repeats=5)
    assert rep["observed_split_half"] < rep["ceiling"] < 1.0, rep
    assert split_half_recall(answers) == pytest.approx(rep["observed_split_half"])


def test_bad_shape_is_refused():
    with pytest.raises(ValueError, match=r"answers must be \[P, n >= 2\]"):
        noise_ceiling([[1.0], [2.0]], ["a", "b"])


def test_cli_ceiling(tmp_path, capsys):
    rng = np.random.default_rng(3)
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(200):
            w = [int(x) for x in np.exp(rng.normal(4 + (i % 5), 0.3, size=3))]
            f.write(json.dumps({"task": f"k{i % 3}", "question": f"q {i}", "resp_words": w}) + "\n")
    assert main(["ceiling", "--data", str(path), "--repeats", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    # five length levels e^1 apart, answer noise 0.3: the longest 20% is one level, which an
    # oracle of the expected length finds whatever the 3 answers drew
    assert out["rows"] == 200 and out["recall@20"]["ceiling"] >= 0.95


def test_cli_ceiling_needs_equal_answer_counts_naming_the_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"question": q, "resp_words": w}) + "\n"
                            for q, w in (("a", [1, 2]), ("b", [3, 4]), ("c", [3]))))
    assert main(["ceiling", "--data", str(path)]) == 2
    assert f"{path}:3: 1 answer in 'resp_words', but line 1 has 2; ceiling needs the same number" in \
        capsys.readouterr().err
    path.write_text(json.dumps({"question": "a", "resp_words": [1]}) + "\n")
    assert main(["ceiling", "--data", str(path)]) == 2
    assert f"{path}:1: 1 answer in 'resp_words'; ceiling needs >= 2" in capsys.readouterr().err


def test_cli_ceiling_notes_a_missing_task_field_and_rounds_q(tmp_path, capsys):
    rng = np.random.default_rng(4)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"question": f"q {i}", "resp_words": [int(x) for x in rng.lognormal(4, 1, 3)]})
                            + "\n" for i in range(60)))
    assert main(["ceiling", "--data", str(path), "--repeats", "2"]) == 0
    err = capsys.readouterr().err
    assert "note: 60 of 60 lines have no 'task' field; they are pooled as one task" in err
    qs = re.findall(r"\(q ([0-9.]+)\)", err)
    assert len(qs) == 3 and all(len(q.split(".")[1]) == 3 for q in qs), err


def test_cli_ceiling_refuses_zero_repeats(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "resp_words": [i, i + 1]}) + "\n" for i in range(20)))
    assert main(["ceiling", "--data", str(path), "--repeats", "0"]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        noise_ceiling([[1.0, 2.0]] * 10, ["t"] * 10, repeats=0)
