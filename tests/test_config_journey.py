"""A user-journey review of the config: each input below was accepted silently (or gave a
traceback, or an error naming the wrong key) and is now one config error naming the key and
the file, or read as the user meant (``~``)."""
import os
from pathlib import Path

import pytest

from controller.config import ConfigError, from_dict, load_config

PLACEMENT = "placement: {generation: [1], trainer: [2]}\n"


def _yaml(tmp_path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(PLACEMENT + text)
    return p


@pytest.mark.parametrize("key, default", [("model.path", "runs/quickstart/model"),
                                          ("logging.logdir", "runs/quickstart")])
@pytest.mark.parametrize("value", ["''", "'  '"])
def test_an_empty_path_is_refused_at_load(tmp_path, key, default, value):
    """``model.path: ''`` / ``logging.logdir: ''`` passed validation and failed in the bootstrap."""
    with pytest.raises(ConfigError, match=rf"^--set {key}={value}: {key}: empty.*default, {default}\)$"):
        load_config(_yaml(tmp_path, ""), 3, [f"{key}={value}"])
    section, k = key.split(".")
    with pytest.raises(ConfigError, match=rf"c.yaml: {key}: empty"):
        load_config(_yaml(tmp_path, f"{section}:\n  {k}: {value}\n"), 3)


def test_a_home_path_is_expanded_at_load(tmp_path):
    """``~/runs/x`` made a folder named ``~`` in the working directory (no shell expands a YAML value)."""
    home = os.path.expanduser("~")
    cfg = load_config(_yaml(tmp_path, "model: {path: ~/m}\nlogging: {logdir: ~/runs/x}\n"), 3,
                      ["ranker.kind=lgbm", "ranker.path=~/r"])
    assert cfg.model.path == f"{home}/m" and cfg.logging.logdir == f"{home}/runs/x"
    assert cfg.ranker.path == f"{home}/r"
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    os.environ["HOME"], saved = str(tmp_path), os.environ["HOME"]
    try:  # a file key: checked to exist after the expansion
        assert from_dict({"train": {"length_trace": "~/t.jsonl"}}).train.length_trace == str(trace)
        with pytest.raises(ConfigError, match=rf"dispatch.profile: {tmp_path}/p.json does not exist"):
            from_dict({"dispatch": {"profile": "~/p.json"}})
    finally:
        os.environ["HOME"] = saved


def test_an_environment_variable_in_a_path_is_expanded(tmp_path, monkeypatch):
    """verl's scripts pass data.train_files=$HOME/data/...: copied into the YAML, "$HOME" was kept
    as written, and the file "did not exist (a relative path resolves from the working directory)"."""
    from workers.tasks.registry import make_task

    monkeypatch.setenv("STREAMRL_DATA", str(tmp_path))
    (tmp_path / "d.jsonl").write_text('{"prompt": "q", "answer": "1"}\n')
    assert load_config(_yaml(tmp_path, "logging: {logdir: $STREAMRL_DATA/runs}\n"), 3).logging.logdir == \
        f"{tmp_path}/runs"
    task = make_task("jsonl", files="${STREAMRL_DATA}/d.jsonl")
    assert task.files["train"] == str(tmp_path / "d.jsonl")
    with pytest.raises(FileNotFoundError, match=r"\$STREAMRL_UNSET_VAR/d.jsonl does not exist"):  # unset: as written
        make_task("jsonl", files="$STREAMRL_UNSET_VAR/d.jsonl")


def test_a_duplicate_key_is_refused_naming_key_file_and_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second ``train:`` section dropped the first's keys."""
    p = _yaml(tmp_path, "train:\n  iterations: 3\n  batch_prompts: 8\n  iterations: 5\n")
    with pytest.raises(ConfigError, match=rf"^{p}:5: train.iterations: given twice \(lines 3 and 5\)"):
        load_config(p, 3)
    p = _yaml(tmp_path, "train: {iterations: 3}\nlogging: {progress: false}\ntrain: {batch_prompts: 8}\n")
    with pytest.raises(ConfigError, match=rf"^{p}:4: train: given twice \(lines 2 and 4\)"):
        load_config(p, 3)
    # a merge key's values may be overridden: that is what '<<' is for
    p = _yaml(tmp_path, "train:\n  <<: {iterations: 3, batch_prompts: 8}\n  iterations: 5\n", "m.yaml")
    assert load_config(p, 3).train.iterations == 5


@pytest.mark.parametrize("text, key, why", [
    ("train: {iterations: 010}\n", "train.iterations", r"010 would read as octal \(8\).*\(10\)"),
    ("placement: {generation: [1], trainer: [02, 010]}\n", r"placement.trainer\[1\]", "octal"),
    ("train: {seed: -010}\n", "train.seed", r"octal \(-8\).*\(-10\)"),
    ("train: {iterations: 1:30}\n", "train.iterations", r"base-60 number \(90\)"),
])
def test_a_number_yaml_11_reads_in_another_base_is_refused(tmp_path, text, key, why):
    """``train.iterations: 010`` ran 8 iterations (YAML 1.1 octal)."""
    p = tmp_path / "c.yaml"
    p.write_text(text if text.startswith("placement") else PLACEMENT + text)
    with pytest.raises(ConfigError, match=rf"^{p}:\d+: {key}: .*{why}"):
        load_config(p, 3)


def test_an_octal_set_is_refused_and_plain_numbers_pass(tmp_path):
    p = _yaml(tmp_path, "train: {iterations: 10, seed: 0, sft_lr: 0.003}\n")
    assert load_config(p, 3, ["train.iterations=0x10"]).train.iterations == 16  # explicit base: meant
    assert load_config(p, 3).train.iterations == 10
    with pytest.raises(ConfigError, match=r"^--set train.iterations=010: train.iterations: 010 would read as octal"):
        load_config(p, 3, ["train.iterations=010"])


def test_a_folder_or_a_non_utf8_file_as_config_is_a_config_error(tmp_path):
    """Both were Python tracebacks (IsADirectoryError, UnicodeDecodeError)."""
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is a folder, not a YAML file"):
        load_config(tmp_path, 3)
    p = tmp_path / "latin1.yaml"
    p.write_bytes(PLACEMENT.encode() + "train: {iterations: 3}  # café\n".encode("latin1"))
    with pytest.raises(ConfigError, match=rf"^{p}:2: not UTF-8 \(byte 0xe9\)"):
        load_config(p, 3)
    p.write_bytes(b"\xef\xbb\xbf" + PLACEMENT.encode())  # a BOM (Windows editors) is fine
    assert load_config(p, 3).placement.trainer == [2]
    p.write_bytes((PLACEMENT + "train: {iterations: 3}  # café\n").encode("utf-16"))  # YAML allows UTF-16 with a BOM
    assert load_config(p, 3).train.iterations == 3  # (it was told to convert from latin1)


def test_a_number_past_pythons_digit_limit_or_nesting_past_its_depth_is_a_config_error(tmp_path):
    """Both were tracebacks on every rank (ValueError, RecursionError; review, s55)."""
    p = tmp_path / "huge.yaml"
    p.write_text(PLACEMENT + "train: {iterations: " + "9" * 5000 + "}\n")
    with pytest.raises(ConfigError, match=rf"^config file {p}: cannot be read \(ValueError: Exceeds the limit"):
        load_config(p, 3)
    p.write_text(PLACEMENT + "logging: {tags: " + "[" * 3000 + "]" * 3000 + "}\n")
    with pytest.raises(ConfigError, match=rf"^config file {p}: cannot be read \(RecursionError"):
        load_config(p, 3)
    p.write_text(PLACEMENT)
    with pytest.raises(ConfigError, match=r"^--set train.iterations=9999.*: the value cannot be read \(ValueError"):
        load_config(p, 3, ["train.iterations=" + "9" * 5000])


def test_a_mistyped_ranker_kind_is_named_before_its_path():
    """``ranker.kind: lgbmm`` (no path yet) was reported as 'ranker.path: ... path is empty'."""
    with pytest.raises(ConfigError, match=r"^ranker.kind: 'lgbmm' is not one of \['none', .*did you mean 'lgbm'"):
        from_dict({"ranker": {"kind": "lgbmm"}})
    with pytest.raises(ConfigError, match=r"^ranker.path: kind 'lgbm' loads a trained ranker folder"):
        from_dict({"ranker": {"kind": "lgbm"}})


def test_the_placement_overlap_advice_is_a_config_that_loads(tmp_path):
    """The advice was 'set placement.colocated', which is refused outside pipeline.mode: colocated."""
    with pytest.raises(ConfigError) as e:
        from_dict({"placement": {"generation": [1], "trainer": [1]}}, 2)
    msg = str(e.value)
    assert "set placement.colocated or" not in msg
    assert "placement.generation=[1] placement.trainer=[2], 3 processes" in msg
    assert from_dict({"placement": {"generation": [1], "trainer": [2]}}, 3)  # the first advice
    second = from_dict({"placement": {"generation": [1], "trainer": [1]}, "pipeline": {"mode": "colocated"}}, 2)
    assert second.placement.colocated is False and second.pipeline.mode == "colocated"  # the second
    with pytest.raises(ConfigError, match=r"placement: ranks \[2\] .*generation=\[1, 2\] placement.trainer=\[3, 4\]"):
        from_dict({"placement": {"generation": [1, 2], "trainer": [2, 3]}}, 4)
