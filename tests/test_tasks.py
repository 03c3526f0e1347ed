"""Tasks and verifiers: synthetic family, reasoning-gym adapter, JSONL files."""
import json
import statistics

import pytest

from workers.tasks import make_task
from workers.tasks.verifiers import exact, extract_answer, make_verifier, numeric
from workers.types import Task, TaskPrompt

MALFORMED = ["", "answer=", "%%%", "1+1=2; answer=notanumber", "answer=99999999999999999999999", "\x00" * 5,
             "answer=3 trailing junk", "+" * 1000]


def test_synthetic_deterministic_and_correct():
    t = make_task("synthetic", num_train=300, seed=3)
    assert isinstance(t, Task)
    a, b = t.prompts("train"), make_task("synthetic", num_train=300, seed=3).prompts("train")
    assert [x.prompt for x in a] == [x.prompt for x in b]
    assert [x.prompt for x in a] != [x.prompt for x in t.prompts("test")[:300]]
    for item in a:
        assert t.score(item, item.answer) == 1.0
        assert t.score(item, " " + item.answer + "\n") == 1.0
    item = TaskPrompt("sum 3 5 2 8", "3+5=8; 8+2=10; 10+8=18; answer=18", "synthetic/running_sum")
    assert t.score(item, "3+5=8; 8+2=11; 10+8=18; answer=18") == pytest.approx(0.5 * 2 / 3 + 0.5)
    assert t.score(item, "3+5=8; 8+2=10; 10+8=18; answer=17") == pytest.approx(0.5)
    assert t.score(item, "3+5=8; answer=18 and more") == pytest.approx(0.5 / 3)
    assert t.score(item, "3+5=8; 3+5=8; 3+5=8; 3+5=8; 3+5=8; 3+5=8") == pytest.approx(0.5 / 6)


def test_synthetic_lengths_depend_on_prompt_and_are_long_tailed():
    t = make_task("synthetic", num_train=2000, max_terms=16)
    lens = [len(x.answer) for x in t.prompts("train")]
    terms = [len(x.prompt.split()) - 1 for x in t.prompts("train")]
    # length grows with the number of terms (visible in the prompt)
    by_n = {n: statistics.mean(l for l, m in zip(lens, terms) if m == n) for n in (2, 4, 8)}
    assert by_n[2] < by_n[4] < by_n[8]
    # long tail: the max is many times the median, the mean above the median
    assert max(lens) > 5 * statistics.median(lens)
    assert statistics.mean(lens) > statistics.median(lens)


@pytest.mark.parametrize("kind", ["running_sum", "countdown"])
def test_verifiers_never_crash(kind):
    t = make_task("synthetic", kind=kind, num_test=20)
    for item in t.prompts("test"):
        assert t.score(item, item.answer) == 1.0
        for bad in MALFORMED:
            s = t.score(item, bad)
            assert 0.0 <= s < 1.0
    assert t.score(TaskPrompt("garbage prompt", "", "x"), "1") == 0.0


def test_synthetic_bad_config():
    with pytest.raises(ValueError, match="kind"):
        make_task("synthetic", kind="nope")
    with pytest.raises(ValueError, match="min_terms"):
        make_task("synthetic", min_terms=5, max_terms=3)
    with pytest.raises(ValueError, match="split"):
        make_task("synthetic").prompts("dev")
    with pytest.raises(ValueError, match="task.name"):
        make_task("nope")
    with pytest.raises(ValueError, match=r"task.kwargs \['colour'\]: .*unexpected keyword argument 'colour'"):
        make_task("synthetic", colour="red")


def test_reasoning_gym_adapter():
    t = make_task("reasoning_gym", dataset="basic_arithmetic", size=5, seed=1)
    items = t.prompts("train")
    assert len(items) == 5 and all(i.task == "reasoning_gym/basic_arithmetic" for i in items)
    for item in items:
        assert t.score(item, f"answer={item.answer}") == 1.0
        assert t.score(item, f"<answer>{item.answer}</answer>") == 1.0
        for bad in MALFORMED:
            assert 0.0 <= t.score(item, bad) < 1.0  # reasoning-gym gives its own partial credit
    assert [i.prompt for i in items] == [i.prompt for i in make_task("reasoning_gym", dataset="basic_arithmetic",
                                                                    size=5, seed=1).prompts("train")]
    assert all(t.score(item, demo) == 1.0 for item, demo in t.demonstrations("train"))
    with pytest.raises(ValueError, match="not registered"):
        make_task("reasoning_gym", dataset="no_such_dataset")


def test_jsonl_task_and_verifiers(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"question": "2+2?", "ref": "4"}, {"question": "half of 3?", "ref": "1.5"}]) + "\n")
    t = make_task("jsonl", files=str(p), verifier="numeric", prompt_key="question", answer_key="ref")
    a, b = t.prompts("train")
    assert (a.prompt, a.answer) == ("2+2?", "4")
    assert t.score(a, "I think answer: 4.0") == 1.0
    assert t.score(b, "<answer>1.50</answer>") == 1.0
    assert t.score(a, "5") == 0.0
    for bad in MALFORMED:
        assert t.score(a, bad) == 0.0
    te = make_task("jsonl", files={"train": str(p)}, verifier="exact", prompt_key="question", answer_key="ref")
    assert te.score(te.prompts("train")[0], "answer=4") == 1.0
    assert te.score(te.prompts("train")[0], "answer=4.0") == 0.0


def test_jsonl_reasoning_gym_verifier(tmp_path):
    p = tmp_path / "rg.jsonl"
    p.write_text(json.dumps({"prompt": "Calculate 5 - 3.", "answer": "2",
                             "metadata": {"expression": "5 - 3"}}) + "\n")
    t = make_task("jsonl", files=str(p), verifier="reasoning_gym:basic_arithmetic")
    item = t.prompts("train")[0]
    assert t.score(item, "answer=2") == 1.0 and t.score(item, "answer=3") == 0.0 and t.score(item, "") == 0.0


def test_jsonl_malformed_line_names_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: malformed JSON"):
        make_task("jsonl", files=str(p)).prompts("train")
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing field 'answer'"):
        make_task("jsonl", files=str(p)).prompts("train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_task("jsonl", files=str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="verifier"):
        make_task("jsonl", files=str(p), verifier="fuzzy")


def test_extract_answer():
    assert extract_answer("blah <answer> 7 </answer>") == "7"
    assert extract_answer("steps; Answer: 12") == "12"
    assert extract_answer("  42 ") == "42"
    item = TaskPrompt("q", "3", "t")
    assert exact(item, "3") == 1.0 and numeric(item, "x = 3.0000000001") == 1.0
    assert make_verifier("exact") is exact


def test_noisy_demonstrations_are_truncated_and_scored_partially():
    t = make_task("synthetic", num_train=400, demo_noise=0.5, seed=2)
    demos = t.demonstrations("train")
    assert [d[0] for d in demos] == list(t.prompts("train"))
    noisy = [(item, text) for item, text in demos if text != item.answer]
    assert 0.4 < len(noisy) / len(demos) < 0.6
    for item, text in noisy:
        assert text.endswith(f"answer={text.split('answer=')[1]}") and 0.0 <= t.score(item, text) < 1.0
    assert all(text == item.answer for item, text in make_task("synthetic", num_train=50).demonstrations("train"))
    with pytest.raises(ValueError, match="demo_noise"):
        make_task("synthetic", demo_noise=1.5)


def test_parquet_task(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow not installed: Parquet datasets are optional")
    import pyarrow as pa

    pq.write_table(pa.table({"prompt": ["1+1?"], "answer": ["2"]}), tmp_path / "d.parquet")
    t = make_task("parquet", files=str(tmp_path / "d.parquet"), verifier="numeric")
    assert t.score(t.prompts("train")[0], "answer: 2") == 1.0


@pytest.mark.parametrize("kwargs", [{"kind": "running_sum", "min_terms": 2, "max_terms": 4, "max_value": 9},  # quickstart
                                    {}, {"kind": "countdown"}])
def test_synthetic_test_split_is_disjoint_from_train(kwargs):
    t = make_task("synthetic", **kwargs)
    train, test = {x.prompt for x in t.prompts("train")}, t.prompts("test")
    assert len(test) == t.num_test and not train & {x.prompt for x in test}
    assert [x.prompt for x in test] == [x.prompt for x in make_task("synthetic", **kwargs).prompts("test")]
    for x in test:
        assert t.score(x, x.answer) == 1.0


def test_synthetic_test_split_when_train_holds_most_of_the_prompt_space():
    # 2 terms up to 3: 9 prompts, all of them among 200 train draws
    with pytest.raises(ValueError, match="every test prompt drawn is a train prompt .* lower task.kwargs.num_train"):
        make_task("synthetic", min_terms=2, max_terms=2, max_value=3, num_train=200).prompts("test")
    # 2 terms up to 5: 25 prompts; the test split is drawn (with repeats, as train is) from those train lacks
    t = make_task("synthetic", min_terms=2, max_terms=2, max_value=5, num_train=30, num_test=50)
    train, test = {x.prompt for x in t.prompts("train")}, {x.prompt for x in t.prompts("test")}
    assert len(t.prompts("test")) == 50 and not train & test and len(train | test) == 25


def test_reasoning_gym_without_reference_answers():
    """propositional_logic and graph_color give answer None (score_answer checks validity):
    demonstrations use metadata['example_answer'] where there is one, else are refused."""
    t = make_task("reasoning_gym", dataset="propositional_logic", size=4)
    demos = t.demonstrations("train")
    assert all(text != "answer=None" and t.score(item, text) == 1.0 for item, text in demos)
    assert all(item.answer == item.meta["metadata"]["example_answer"] for item, _ in demos)
    g = make_task("reasoning_gym", dataset="graph_color", size=2)
    assert all(item.answer == "" for item in g.prompts("train"))
    assert g.score(g.prompts("train")[0], "answer=None") == 0.0  # the reward is the dataset's own, as before
    with pytest.raises(ValueError, match=r"dataset 'graph_color' gives no reference answer .* no "
                                         r"metadata\['example_answer'\].*set train.sft_steps: 0"):
        g.demonstrations("train")
