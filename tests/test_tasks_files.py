"""Data files as the jsonl/parquet tasks read them: encodings, JSON arrays, and the rows refused
(naming file, line and key) or accepted as transformers and HF datasets would."""
import json

import pytest

from workers.tasks import make_task


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_null_reference_is_refused_naming_line_and_key(tmp_path):
    p = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}])
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'answer' is null: every row needs a reference answer"):
        make_task("jsonl", files=p).prompts("train")
    p = write_rows(tmp_path / "v.jsonl", [{"prompt": "a", "reward_model": {"ground_truth": None}}])
    with pytest.raises(ValueError, match=r"v.jsonl:1: field 'reward_model.ground_truth' is null"):
        make_task("jsonl", files=p, answer_key="reward_model.ground_truth", verifier="numeric").prompts("train")


def test_an_empty_reference_is_refused_for_a_built_in_verifier(tmp_path):
    """``exact`` and ``numeric`` scored an empty completion 1.0 against "" (review, session 52):
    a table's missing answer stored as an empty string taught the policy to say nothing."""
    p = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "4"}, {"prompt": "b", "answer": "  "}])
    for verifier in ("exact", "numeric", "math"):
        with pytest.raises(ValueError, match=r"d.jsonl:2: field 'answer' is '  ', an empty reference answer"):
            make_task("jsonl", files=p, verifier=verifier).prompts("train")
    f = tmp_path / "r.py"  # the user's own function gets it as it is
    f.write_text("def fn(prompt, completion):\n    return float(completion == prompt.answer)\n")
    assert make_task("jsonl", files=p, verifier=f"{f}:fn").prompts("train")[1].answer == "  "


def test_a_nan_or_infinite_reference_is_refused_naming_line_and_key(tmp_path):
    p = tmp_path / "d.jsonl"  # json.dumps writes NaN / Infinity, which json.loads reads back as floats
    for bad in (float("nan"), float("inf")):
        write_rows(p, [{"prompt": "a", "answer": 1.5}, {"prompt": "b", "answer": bad}])
        with pytest.raises(ValueError, match=r"d.jsonl:2: field 'answer' is (nan|inf), not a reference answer"):
            make_task("jsonl", files=str(p)).prompts("train")
    write_rows(p, [{"prompt": "a", "answer": 1.5}])
    assert make_task("jsonl", files=str(p)).prompts("train")[0].answer == "1.5"


def test_a_null_reference_in_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed: Parquet datasets are optional")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]),
                   tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d.parquet:row 1: field 'answer' is null"):
        make_task("parquet", files=str(tmp_path / "d.parquet")).prompts("train")


def test_a_parquet_tasks_rows_are_its_own_eval_group(tmp_path):
    # rows with no task / data_source were logged as eval/jsonl (review, s54)
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed: Parquet datasets are optional")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}]), tmp_path / "d.parquet")
    assert make_task("parquet", files=str(tmp_path / "d.parquet")).prompts("train")[0].task == "parquet"
    assert make_task("parquet", files=str(tmp_path / "d.parquet"), name="m").prompts("train")[0].task == "m"
    with pytest.raises(ValueError, match=r"task 'parquet': task.kwargs \['filez'\]: "):  # not the default's name
        make_task("parquet", filez=str(tmp_path / "d.parquet"))


def test_a_list_reference_needs_the_users_own_verifier(tmp_path):
    p = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "answer": ["2", "two"]}])
    with pytest.raises(ValueError, match=r"d.jsonl:1: field 'answer' is a list .*the built-in verifiers compare one "
                                         r"answer, a string or a number"):
        make_task("jsonl", files=p).prompts("train")
    f = tmp_path / "r.py"
    f.write_text("def score(prompt, completion):\n    return float(completion in prompt.raw_answer)\n")
    t = make_task("jsonl", files=p, verifier=f"{f}:score")
    assert t.score(t.prompts("train")[0], "two") == 1.0


def test_non_utf8_names_line_and_byte(tmp_path):
    p = tmp_path / "latin.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl:2: not UTF-8 \(byte 0xe9 at column 16, counted in bytes\)"):
        make_task("jsonl", files=str(p)).prompts("train")


def test_a_utf8_bom_is_accepted(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "caf\u00e9", "answer": "1"}\n'.encode())
    assert make_task("jsonl", files=str(p)).prompts("train")[0].prompt == "caf\u00e9"


def test_a_json_array_file_is_read(tmp_path):
    p = tmp_path / "arr.json"
    p.write_text(json.dumps([{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}], indent=2))
    t = make_task("jsonl", files=str(p), verifier="numeric")
    assert [(i.prompt, i.answer) for i in t.prompts("train")] == [("1+1?", "2"), ("2+2?", "4")]
    p.write_text(json.dumps([{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?"}], indent=2))
    with pytest.raises(ValueError, match=r"arr.json\[1\]: missing field 'answer'"):
        make_task("jsonl", files=str(p)).prompts("train")
    p.write_text('[\n  {"prompt": "1+1?", "answer": "2"},\n  {"prompt": }\n]')
    with pytest.raises(ValueError, match=r"arr.json:3: malformed JSON array \(Expecting value at column 14\)"):
        make_task("jsonl", files=str(p)).prompts("train")
    lines = tmp_path / "lines.json"  # JSON Lines under .json still read
    lines.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n')
    assert len(make_task("jsonl", files=str(lines)).prompts("train")) == 2


def test_whitespace_prompts_are_refused_like_empty_ones(tmp_path):
    p = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "   \n", "answer": "1"}])
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'prompt' must be a string with some text"):
        make_task("jsonl", files=p).prompts("train")
    p = write_rows(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": " "}], "answer": "1"}])
    with pytest.raises(ValueError, match=r"c.jsonl:1: field 'prompt' must be a string with some text"):
        make_task("jsonl", files=p).prompts("train")


def test_a_lone_surrogate_is_refused_at_its_row(tmp_path):
    """JSON can write "\\ud800", UTF-8 cannot: the row was read, and the tokenizer failed on it
    after the engines were built, naming no file (review, s55)."""
    p = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "a\ud800b", "answer": "1"}])
    with pytest.raises(ValueError, match=r"d.jsonl:2: field 'prompt' has a lone surrogate '\\ud800' at char 1"):
        make_task("jsonl", files=p).prompts("train")
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]
    p = write_rows(tmp_path / "c.jsonl", [{"prompt": chat, "answer": "1"}])
    with pytest.raises(ValueError, match=r"c.jsonl:1: field 'prompt\[1\].content' has a lone surrogate"):
        make_task("jsonl", files=p).prompts("train")


def test_a_tool_call_turn_may_have_null_content(tmp_path):
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
            {"role": "tool", "content": "sunny"}, {"role": "user", "content": "so?"}]
    p = write_rows(tmp_path / "d.jsonl", [{"prompt": chat, "answer": "sunny"}])
    item = make_task("jsonl", files=p).prompts("train")[0]
    assert item.prompt == "so?" and item.messages[1]["content"] is None and "tool_calls" in item.messages[1]
    p = write_rows(tmp_path / "u.jsonl", [{"prompt": [{"role": "user", "content": None}], "answer": "1"}])
    with pytest.raises(ValueError, match=r"u.jsonl:1: prompt\[0\]: content must be a string or a list of text parts "
                                         r"\(null only in an assistant or tool turn\)"):
        make_task("jsonl", files=p).prompts("train")


def test_a_row_records_its_file_and_line(tmp_path):
    p = write_rows(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2", "source": "web"}])
    a, b = make_task("jsonl", files=p).prompts("train")
    from workers.tasks.rows import WHERE

    assert a.meta[WHERE] == f"{p}:1" and b.meta[WHERE] == f"{p}:2"
    assert b.meta["source"] == "web"  # the row's own field is kept, and no longer hides the location


def test_an_empty_data_file_is_named(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"e.jsonl: no rows \(task.kwargs.files.train\)"):
        make_task("jsonl", files=str(tmp_path / "e.jsonl")).prompts("train")


def test_a_tool_call_turn_without_content_renders_without_a_chat_template():
    # transformers accepts an assistant turn with content null (a tool call); with no chat
    # template the turns' contents are joined, and a null one adds no "None" to the prompt
    from workers.tokenizer import train_bpe

    tok = train_bpe(["what is 2 + 2 ? call a tool"] * 20, vocab_size=300)
    msgs = [{"role": "user", "content": "what is 2 + 2 ?"}, {"role": "assistant", "content": None},
            {"role": "tool", "content": "4"}]
    text = tok.format_prompt("4", msgs)
    assert "None" not in text and "what is 2 + 2 ?" in text and "4" in text


def test_a_tool_call_turn_without_content_does_not_stop_a_tokenizer_build():
    # model.init builds the tokenizer from the train prompts' texts, turns included
    from types import SimpleNamespace

    from workers.trainer.bootstrap import build_tokenizer
    from workers.types import TaskPrompt

    msgs = ({"role": "user", "content": "what is 2 + 2 ?"}, {"role": "assistant", "content": None})
    task = SimpleNamespace(prompts=lambda split: [TaskPrompt("what is 2 + 2 ?", "4", "t", messages=msgs)] * 20)
    assert build_tokenizer(task, 300).encode("what is")


def test_a_missing_or_unreadable_file_is_named_by_the_key_the_user_wrote(tmp_path):
    """The key is task.kwargs.files.<split>, as written in the config (it said task.files['train'])."""
    import pytest

    from workers.tasks.registry import make_task

    with pytest.raises(FileNotFoundError, match=r"^task.kwargs.files.train: .*nope.jsonl does not exist$"):
        make_task("jsonl", files={"train": str(tmp_path / "nope.jsonl")})
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"^task.kwargs.files.train: .*rows.csv: a .csv file; the readers take \["):
        make_task("jsonl", files={"train": str(tmp_path / "rows.csv")})


def test_a_folder_as_a_data_file_is_refused_naming_the_key(tmp_path):
    """A folder named like a data file (``data.jsonl/``) passed the start check and failed on the
    first read with ``[Errno 21] Is a directory``, naming no key."""
    train = write_rows(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}])
    for folder in ("d.jsonl", "d"):
        (tmp_path / folder).mkdir()
        with pytest.raises(ValueError, match=rf"^task.kwargs.files.test: .*{folder} is a folder; give one data file"):
            make_task("jsonl", files={"train": train, "test": str(tmp_path / folder)})
    # named as written: val / validation stand for test, but the config says val
    with pytest.raises(ValueError, match=r"^task.kwargs.files.val: .*d is a folder"):
        make_task("jsonl", files={"train": train, "val": str(tmp_path / "d")})
    with pytest.raises(FileNotFoundError, match=r"^task.kwargs.files.validation: .*missing.jsonl does not exist"):
        make_task("jsonl", files={"train": train, "validation": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ValueError, match=r"^task.kwargs.files: .*d is a folder"):  # one path for every split
        make_task("jsonl", files=str(tmp_path / "d"))


def test_val_beside_test_or_an_unknown_split_is_refused(tmp_path):
    """``val`` stands for ``test``; given beside ``test`` it was silently never read (verl users
    list both), as was any split the run does not read."""
    t = write_rows(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}])
    v = write_rows(tmp_path / "v.jsonl", [{"prompt": "b", "answer": "2"}])
    with pytest.raises(ValueError, match=r"^task.kwargs.files: test and val both name the test split.*keep one"):
        make_task("jsonl", files={"train": t, "test": t, "val": v})
    with pytest.raises(ValueError, match=r"^task.kwargs.files.dev: not a split"):
        make_task("jsonl", files={"train": t, "dev": v})
    assert make_task("jsonl", files={"train": t, "val": v}).prompts("test")[0].prompt == "b"
    assert make_task("jsonl", files={"train": t, "validation": v}).prompts("test")[0].prompt == "b"


def test_a_missing_relative_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"^task.kwargs.files.train: data/t.jsonl does not exist \(a relative "
                                                rf"path resolves from the working directory, {tmp_path}\)$"):
        make_task("jsonl", files={"train": "data/t.jsonl"})
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}/t.jsonl does not exist$"):
        make_task("jsonl", files={"train": str(tmp_path / "t.jsonl")})


def test_a_home_verifier_file_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "r.py").write_text("def score(prompt, completion):\n    return 1.0\n")
    write_rows(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "1"}])
    task = make_task("jsonl", files="~/t.jsonl", verifier="~/r.py:score")
    assert task.score(task.prompts("train")[0], "x") == 1.0


def test_a_task_kwarg_called_name_names_the_eval_group(tmp_path):
    # task.kwargs.name (the documented eval group) clashed with make_task's own argument:
    # "make_task() got multiple values for argument 'name'", a traceback on every run
    p = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+2=", "answer": "3", "data_source": None},
            {"prompt": "2+2=", "answer": "4", "data_source": "gsm"}, {"prompt": "2+3=", "answer": "5", "task": 7},
            {"prompt": "3+3=", "answer": "6", "task": ["x"], "data_source": "mix"}, {"prompt": "4+4=", "answer": "8",
                                                                                  "task": " "}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = make_task("jsonl", files=str(p), name="mymath")
    # a null, empty or non-scalar field names no group (a null one was the group "None")
    assert [i.task for i in t.prompts("train")] == ["mymath", "mymath", "gsm", "7", "mix", "mymath"]


@pytest.mark.parametrize("key,value", [("prompt_key", None), ("answer_key", 5), ("name", ""), ("prompt_key", " ")])
def test_the_field_keys_are_strings(tmp_path, key, value):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match=rf"^task.kwargs.{key}: a non-empty string \(.*\), got {value!r}$"):
        make_task("jsonl", files=str(p), **{key: value})  # was AttributeError: 'NoneType' ... 'split'


def test_an_unknown_reasoning_gym_verifier_names_the_key(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"^task.kwargs.verifier: 'reasoning_gym:nonexistent_ds': 'nonexistent_ds' "
                                         r"is not a registered reasoning-gym dataset"):
        make_task("jsonl", files=str(p), verifier="reasoning_gym:nonexistent_ds")


def test_a_column_named_with_a_dot_is_read(tmp_path):
    """``datasets``' ``flatten()`` writes verl's nested field as a column named
    ``reward_model.ground_truth``: the dotted key was only read as a path and the file was refused
    listing that very column as present."""
    p = tmp_path / "flat.jsonl"
    p.write_text(json.dumps({"prompt": "What is 2+2?", "reward_model.ground_truth": "4"}) + "\n")
    task = make_task("jsonl", files=str(p), answer_key="reward_model.ground_truth", verifier="gsm8k")
    assert [i.answer for i in task.prompts("train")] == ["4"]


ROWS = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]


@pytest.mark.parametrize("sep, tail", [("\n", ""), ("\n", "\n"), ("\r\n", "\r\n"), ("\n", "\n\n")])
def test_every_jsonl_row_is_read_whatever_the_file_ends_with(tmp_path, sep, tail):
    """A JSONL file whose last line has no newline (an editor, json.dumps joined by "\\n") keeps its
    last row; CRLF line ends too."""
    p = tmp_path / "d.jsonl"
    p.write_text(sep.join(json.dumps(r) for r in ROWS) + tail, newline="")
    items = make_task("jsonl", files=str(p)).prompts("train")
    assert [(i.prompt, i.answer) for i in items] == [(r["prompt"], r["answer"]) for r in ROWS]


def test_one_path_serves_both_splits(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    t = make_task("jsonl", files=str(p))
    assert [i.prompt for i in t.prompts("test")] == [i.prompt for i in t.prompts("train")] == [r["prompt"] for r in ROWS]


def test_a_rows_task_field_names_its_group_before_data_source(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "1+1?", "answer": "2", "task": "arith", "data_source": "gsm8k"}) + "\n")
    assert make_task("jsonl", files=str(p)).prompts("train")[0].task == "arith"


def test_text_content_parts_are_joined_as_they_are(tmp_path):
    p = tmp_path / "d.jsonl"
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "1+1?"}]
    p.write_text(json.dumps({"prompt": [{"role": "user", "content": parts}], "answer": "2"}) + "\n")
    item = make_task("jsonl", files=str(p)).prompts("train")[0]
    assert item.prompt == "What is 1+1?" and item.messages[0]["content"] == "What is 1+1?"
