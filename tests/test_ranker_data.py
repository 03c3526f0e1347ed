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
    (b"", r":2: blank line"),
    (b"  \t\r", r":2: blank line"),
    (b'{"question": "x", "resp_words": [1' + b"0" * 400 + b']}', r":2: field 'resp_words' must be"),
    (json.dumps({"question": "x", "resp_words": [1e39]}).encode(), r":2: field 'resp_words' must be"),
    (b"[" * 100000 + b"]" * 100000, r":2: not a JSON object \(nested too deeply\)"),
    (b'{"question": "bad \\ud800", "resp_words": [1]}', r":2: field 'question' has a lone surrogate"),
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


def test_corrupt_gzip_names_the_file(tmp_path):
    data = bytearray(gzip.compress(b"\n".join([GOOD] * 50) + b"\n"))
    data[20:40] = b"\xff" * 20  # damaged deflate stream, full length
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match=r"c.jsonl.gz(:\d+)?: cannot read"):
        read_traces(path)


def test_gz_suffix_is_case_insensitive(tmp_path):
    path = _write(tmp_path / "T.JSONL.GZ", [GOOD])
    assert read_traces(path)[0].target == 12.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import ranker
    from test_ranker_synth import synth

    d = tmp_path_factory.mktemp("model") / "m"
    ranker.build("lgbm", **SMALL_LGBM).fit(*synth(200, seed=0)).save(d)
    return d


def _strict_json(text: str):
    def refuse(c):
        raise AssertionError(f"{c} in stdout JSON")
    return json.loads(text.strip().splitlines()[-1], parse_constant=refuse)


@pytest.mark.parametrize("config, key", [
    ('{"nope": 1}', "'nope'"),
    ('{"features": {"nope": 1}}', "'nope'"),
    ('{"rounds": "10"}', "'rounds'"),
    ('{"rounds": 2.5}', "'rounds'"),
    ('{"learning_rate": -1}', "'learning_rate'"),
    ('{"num_leaves": 1}', "'num_leaves'"),
    ('{"subsample": 0}', "'subsample'"),
    ("null", "expected a JSON object"),
    ("[1]", "expected a JSON object"),
    ("{rounds: 1}", "not valid JSON"),
])
def test_cli_bad_config_exits_2_before_reading_data(tmp_path, capsys, config, key):
    # --train does not exist: the config must be refused first
    assert main(["train", "--train", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "m"),
                 "--config", config]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and key in err, err


def test_cli_output_paths_that_cannot_be_written(tmp_path, capsys, model_dir):
    data = _write(tmp_path / "d.jsonl.gz", [GOOD, GOOD])
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for out in (tmp_path, a_file / "pred.jsonl"):
        assert main(["predict", "--model", str(model_dir), "--input", str(data), "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--output {out}:" in err, err
    assert main(["train", "--train", str(data), "--out", str(a_file / "m")]) == 2
    assert f"--out {a_file / 'm'}: cannot create it, {a_file} is not a folder" in capsys.readouterr().err
    assert a_file.read_text() == "x"


def test_cli_nan_metrics_print_null(tmp_path, capsys, model_dir):
    same = json.dumps({"question": "Sort 3, 1, 2", "resp_words": [5, 5, 5]}).encode()
    data = _write(tmp_path / "const.jsonl.gz", [same] * 30)  # equal lengths: rank correlations are NaN
    assert main(["eval", "--model", str(model_dir), "--data", str(data)]) == 0
    rep = _strict_json(capsys.readouterr().out)
    assert rep["model"]["kendall_tau"] is None and rep["model"]["spearman"] is None
    train = write_trace(tmp_path / "s.train.jsonl.gz", 60, seed=0)
    assert main(["train", "--train", str(train), "--val", str(data), "--out", str(tmp_path / "m"),
                 "--config", json.dumps(SMALL_LGBM)]) == 0
    assert _strict_json(capsys.readouterr().out)["val"]["spearman"] is None


def test_cli_bad_val_line_stops_before_training(tmp_path, capsys):
    train = write_trace(tmp_path / "s.train.jsonl.gz", 60, seed=0)
    val = _write(tmp_path / "v.jsonl.gz", [GOOD, b"not json"])
    assert main(["train", "--train", str(train), "--val", str(val), "--out", str(tmp_path / "m"),
                 "--config", json.dumps(SMALL_LGBM)]) == 2
    assert "v.jsonl.gz:2: not a JSON object" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # nothing was trained or saved


def _plain(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_blank_lines_only_at_the_end(tmp_path):
    path = _plain(tmp_path / "t.jsonl", [GOOD, GOOD, b"", b"  "])  # trailing blank lines: ignored
    assert [r.line for r in read_traces(path)] == [1, 2]
    path = _plain(tmp_path / "t.jsonl", [GOOD, b"", b"", GOOD])
    with pytest.raises(TraceError, match=r"t.jsonl:2: blank line \(only the end of the file may have blank lines\)"):
        read_traces(path)
    with pytest.raises(TraceError, match=r"t.jsonl: no rows"):
        read_traces(_plain(tmp_path / "t.jsonl", [b""]))


def test_gzip_data_in_a_plain_name_and_a_bom_are_recognised(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(gzip.compress(GOOD + b"\n"))
    with pytest.raises(TraceError, match=r"t.jsonl:1: gzip data \(starts with bytes 1f 8b\) .*rename it to end in .gz"):
        read_traces(path)
    path.write_bytes(b"\xef\xbb\xbf" + GOOD + b"\n" + GOOD + b"\n")  # a UTF-8 byte-order mark on line 1
    assert [r.target for r in read_traces(path)] == [12.0, 12.0]


def test_cli_quick_and_nested_config_are_merged():
    import argparse

    from ranker.cli import QUICK, _config

    a = argparse.Namespace(kind="ensemble", quick=True, config='{"lm": {"threads": 1}, "lgbm_weight": 0.5}')
    assert _config(a) == {"lgbm": {"rounds": 60}, "lm": {"epochs": 1, "max_tokens": 128, "threads": 1},
                          "lgbm_weight": 0.5}
    assert QUICK["ensemble"]["lm"] == {"epochs": 1, "max_tokens": 128}  # not changed in place


@pytest.mark.parametrize("kind, config, key", [
    ("lm", '{"vocab_size": 100}', "'vocab_size' must be >= 258"),
    ("lm", '{"hidden": 30, "heads": 4}', "'hidden' must be a multiple of 2 x heads"),
    ("lm", '{"heads": 4, "kv_heads": 3}', "'kv_heads' must be a divisor of heads (4)"),
    ("ensemble", '{"lm": {"hidden": 12, "heads": 4, "kv_heads": 2}}', "'hidden' must be a multiple of 2 x heads"),
    ("lgbm", '{"features": {"space": {"max_columns": 1}}}', "'max_columns' must be >= 2"),
])
def test_cli_config_values_that_would_fail_in_fit_exit_2_first(tmp_path, capsys, kind, config, key):
    assert main(["train", "--kind", kind, "--train", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "m"),
                 "--config", config]) == 2
    err = capsys.readouterr().err
    assert "error: --config" in err and key in err, err


def test_cli_eval_baseline_notes_and_errors(tmp_path, capsys, model_dir):
    data = write_trace(tmp_path / "d.jsonl.gz", 40, seed=1)  # no .val. in the name: no sibling
    assert main(["eval", "--model", str(model_dir), "--data", str(data)]) == 0
    captured = capsys.readouterr()
    assert "note: no TF-IDF ridge baseline" in captured.err and "--baseline-train FILE" in captured.err
    assert "tfidf_ridge" not in json.loads(captured.out.strip().splitlines()[-1])
    one = _write(tmp_path / "one.jsonl.gz", [GOOD])
    assert main(["eval", "--model", str(model_dir), "--data", str(data), "--baseline-train", str(one)]) == 2
    err = capsys.readouterr().err
    assert f"error: --baseline-train {one}: cannot fit the TF-IDF baseline on it (needs at least 2 training " \
           f"prompts, got 1)" in err


def test_cli_model_errors_name_the_folder(tmp_path, capsys, model_dir):
    data = write_trace(tmp_path / "d.jsonl.gz", 20, seed=1)
    assert main(["eval", "--model", str(tmp_path / "nope"), "--data", str(data)]) == 2
    assert f"error: {tmp_path / 'nope'}: does not exist" in capsys.readouterr().err
    assert main(["eval", "--model", str(data), "--data", str(data)]) == 2
    assert f"error: {data}: is not a folder" in capsys.readouterr().err


def test_cli_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    from ranker.lgbm import LgbmRanker

    def interrupted(self, prompts, lengths):
        raise KeyboardInterrupt
    monkeypatch.setattr(LgbmRanker, "fit", interrupted)
    train = write_trace(tmp_path / "s.train.jsonl.gz", 60, seed=0)
    assert main(["train", "--train", str(train), "--out", str(tmp_path / "m"), "--quick"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    assert not (tmp_path / "m").exists()


def test_every_cli_flag_has_help():
    from ranker.cli import parser

    sub = next(a for a in parser()._actions if a.dest == "cmd")
    for name, p in sub.choices.items():
        for action in p._actions:
            assert action.help, (name, action.option_strings)


def test_cli_names_held_out_rows_whose_prompt_is_in_train(tmp_path, capsys):
    """(The shipped llama33 traces share 8 val prompts with train: those rows flatter a ranker
    whose neighbour features find the row itself.)"""
    train = write_trace(tmp_path / "s.train.jsonl.gz", 300, seed=0)
    with gzip.open(train, "rt") as f:
        copied = f.readlines()[:25]
    fresh = write_trace(tmp_path / "fresh.jsonl.gz", 40, seed=1)
    with gzip.open(fresh, "rt") as f:
        rest = f.readlines()
    val = tmp_path / "s.val.jsonl.gz"
    with gzip.open(val, "wt") as f:
        f.writelines(copied + rest)
    in_train = {json.loads(x)["question"] for x in copied} | ({json.loads(x)["question"] for x in rest}
                                                              & {r.prompt for r in read_traces(train)})
    want = sum(json.loads(x)["question"] in in_train for x in copied + rest)
    assert want >= 25
    assert main(["train", "--train", str(train), "--val", str(val), "--out", str(tmp_path / "m"), "--quick",
                 "--config", json.dumps(SMALL_LGBM)]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["val_rows_in_train"] == want
    assert f"note: {want} of the 65 rows of --val {val} have a prompt that is also in --train {train}" in out.err
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(val)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows_in_baseline_train"] == want


def test_cli_errors_name_the_file_and_the_full_key_path(tmp_path, capsys):
    small = write_trace(tmp_path / "small.train.jsonl.gz", 5)
    assert main(["train", "--train", str(small), "--out", str(tmp_path / "m")]) == 2
    assert f"--train {small}: 5 rows; the lgbm ranker needs at least 20" in capsys.readouterr().err
    big = write_trace(tmp_path / "big.train.jsonl.gz", 30)
    for cfg, said in (({"lgbm": {"features": {"knn_k": 0}}}, "ensemble.lgbm.features config key 'knn_k'"),
                      ({"lm": {"hidden": 30}}, "ensemble.lm config key 'hidden'"),
                      ({"lgbm": {"features": {"space": {"svd_dims": 0}}}}, "ensemble.lgbm.features.space config")):
        assert main(["train", "--kind", "ensemble", "--train", str(big), "--out", str(tmp_path / "m2"),
                     "--config", json.dumps(cfg)]) == 2
        assert said in capsys.readouterr().err, cfg
