"""Trace reading and CLI: bad lines are refused naming file and line; train/predict/eval
smoke on a small synthetic trace."""
from __future__ import annotations

import gzip
import json

import pytest

from ranker.cli import main
from ranker.data import TraceError, read_traces
from test_ranker_synth import SMALL_LGBM, write_trace


def _write(path, lines: list[bytes]):
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return path


GOOD = json.dumps({"question": "Sort 3, 1, 2", "resp_words": [10, 12, 14]}).encode()


@pytest.mark.parametrize("bad, msg", [
    (json.dumps({"question": "", "resp_words": [1]}).encode(), r":2: empty prompt"),
    (b'{"question": "caf\xe9", "resp_words": [1]}', r":2: line is not valid UTF-8"),
    (json.dumps({"prompt": "x", "resp_words": [1]}).encode(), r":2: missing field 'question'"),
    (json.dumps({"question": "x"}).encode(), r":2: missing field 'resp_words'"),
    (json.dumps({"question": "x", "resp_words": []}).encode(), r":2: field 'resp_words' must be"),
    (json.dumps({"question": "x", "resp_words": [-3]}).encode(), r":2: field 'resp_words' must be"),
    (b"not json", r":2: not a JSON object"),
    (b"[1, 2]", r":2: expected a JSON object"),
    (b"", r":2: not a JSON object"),
])
def test_bad_lines_name_the_line(tmp_path, bad, msg):
    path = _write(tmp_path / "t.jsonl.gz", [GOOD, bad, GOOD])
    with pytest.raises(TraceError, match=msg):
        read_traces(path)


def test_target_is_mean_words_and_plain_files_work(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD.decode() + "\n")
    (row,) = read_traces(p)
    assert row.line == 1 and row.prompt == "Sort 3, 1, 2" and row.target == 12.0
    # predict input needs no lengths
    p.write_text(json.dumps({"question": "q"}) + "\n")
    assert read_traces(p, need_lengths=False)[0].prompt == "q"


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_traces(tmp_path / "nope.jsonl.gz")


def test_cli_train_predict_eval(tmp_path, capsys):
    train = write_trace(tmp_path / "s.train.jsonl.gz", 300, seed=0)
    val = write_trace(tmp_path / "s.val.jsonl.gz", 120, seed=1)
    model = tmp_path / "model"
    cfg = json.dumps(SMALL_LGBM)
    assert main(["train", "--train", str(train), "--val", str(val), "--out", str(model),
                 "--quick", "--config", cfg]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["train_rows"] == 300 and summary["val"]["recall@20"] >= 0.8
    out = tmp_path / "pred.jsonl"
    assert main(["predict", "--model", str(model), "--input", str(val), "--output", str(out)]) == 0
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert [l["idx"] for l in lines] == list(range(1, 121))
    assert all(isinstance(l["pred_len"], float) and l["pred_len"] >= 0 for l in lines)
    assert main(["eval", "--model", str(model), "--data", str(val)]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(rep) >= {"model", "prompt_length", "tfidf_ridge"}
    assert rep["tfidf_ridge_train"] == str(train)
    for name in ("model", "prompt_length", "tfidf_ridge"):
        assert set(rep[name]) == {"recall@10", "recall@20", "recall@30", "kendall_tau", "spearman"}
    assert rep["model"]["recall@20"] >= 0.8


def test_cli_bad_input_exits_2_naming_the_line(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl.gz", [GOOD, GOOD, b'{"resp_words": [1]}'])
    assert main(["train", "--train", str(bad), "--out", str(tmp_path / "m"), "--quick"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl.gz:3: missing field 'question'" in err
    assert main(["predict", "--model", str(tmp_path / "none"), "--input", str(bad),
                 "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "bad.jsonl.gz:3: missing field 'question'" in capsys.readouterr().err
