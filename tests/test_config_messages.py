"""Config error messages as the user sees them: optional string keys take YAML null, a
``--set`` is echoed exactly as typed, a value that is not YAML gets advice for the key's type,
dispatcher options name what the dispatcher takes, and a user task's own error is not blamed
on its kwargs."""
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from controller.config import ConfigError, from_dict, load_config
from controller.config_overrides import parse_override
from workers.tasks.registry import make_task

DOCS = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def _file(tmp_path, **sections):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"placement": {"generation": [1], "trainer": [2]}, **sections}))
    return p


# ---- 3: a string key whose default is empty takes YAML null as that empty string --------------
OPTIONAL_STR = [("dispatch", "profile"), ("ranker", "path"), ("train", "length_trace"),
                ("tokenizer", "prompt_template"), ("engine", "device"), ("engine", "dtype"), ("multi_turn", "env")]


@pytest.mark.parametrize("section, key", OPTIONAL_STR)
def test_null_for_an_optional_string_key_is_empty(tmp_path, section, key):
    cfg = load_config(_file(tmp_path), 3, [f"{section}.{key}=null"])
    assert getattr(getattr(cfg, section), key) == ""
    cfg = load_config(_file(tmp_path), 3, [f"{section}.{key}="])  # `--set key=` is YAML null too
    assert getattr(getattr(cfg, section), key) == ""
    p = tmp_path / "blank.yaml"  # `profile:` in the file
    p.write_text(f"placement: {{generation: [1], trainer: [2]}}\n{section}:\n  {key}:\n")
    assert getattr(getattr(load_config(p, 3), section), key) == ""


def test_null_is_still_refused_for_a_string_key_that_has_a_value():
    with pytest.raises(ConfigError, match=r"^pipeline.mode: is empty \(YAML null: nothing after the ':' or '='\); "
                                          r"expected a string$"):
        from_dict({"pipeline": {"mode": None}})
    with pytest.raises(ConfigError, match=r"^placement.colocated: is empty .*expected true or false$"):
        from_dict({"placement": {"colocated": None}})


def test_docs_give_the_dispatch_profile_default_as_empty():
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `dispatch.profile`"))
    assert row.startswith("| `dispatch.profile` | empty |") and "empty or null: a flat default" in row, row
    assert "none: a flat default" not in row


def test_the_oracle_dispatcher_is_refused_for_a_run(tmp_path):
    # it plans on the true output lengths: a run crashed in its first iteration
    with pytest.raises(ConfigError, match=r"dispatch.name: oracle: the oracle dispatcher plans on the true output "
                                          r"lengths, which a training run does not know"):
        load_config(_file(tmp_path), 3, ["dispatch.name=oracle"])


# ---- 9: dispatch.options name the dispatcher and the options it takes --------------------------
@pytest.mark.parametrize("name, options, message", [
    ("round_robin", "{alphas: 3}", "dispatch.options: dispatcher 'round_robin' takes only 'order', got ['alphas']"),
    ("random", "{order: lpt, alpha: 0.2}", "dispatch.options: dispatcher 'random' takes only 'order', got ['alpha']"),
    ("skew", "{alpha: [0.2]}", "dispatch.options: dispatcher 'skew' takes the options alphas, cost, q_long, "
                               "q_regular, quantile_of, order, noise, mixed, orders, draws, mixed_order, got "
                               "['alpha']; did you mean 'alphas'?"),
    ("oracle", "{kind: x}", "dispatch.options: dispatcher 'oracle' takes the options alphas,"),
    ("skew", "{alphas: 3}", "dispatch.options: skew dispatcher: alphas must be a list (e.g. alphas: [0.1, 0.2]), "
                            "got 3"),
    ("skew_paper", "{alphas: [x]}", "dispatch.options: skew dispatcher: alphas must be a list of fractions in "
                                    "(0, 1), got ['x']"),
    ("skew", "{orders: lpt}", "dispatch.options: skew dispatcher: orders must be a list (e.g. orders: ['lpt']), "
                              "got 'lpt'"),
    # values: each of these passed the load check and crashed iteration 0 (or was silently wrong)
    ("skew", "{draws: 0}", "dispatch.options: skew dispatcher: draws must be an int >= 1, got 0"),
    ("skew", "{draws: 2.5}", "dispatch.options: skew dispatcher: draws must be an int >= 1, got 2.5"),
    ("skew", "{noise: .nan}", "dispatch.options: skew dispatcher: noise must be a finite log-error std >= 0, got nan"),
    ("skew", "{noise: '0.3'}", "dispatch.options: skew dispatcher: noise must be a finite log-error std >= 0, got '0.3'"),
    ("skew", "{q_long: 1.5}", "dispatch.options: skew dispatcher: q_long must be a quantile in [0, 1], got 1.5"),
    ("skew_paper", "{q_regular: x}", "dispatch.options: skew dispatcher: q_regular must be a quantile in [0, 1], "
                                     "got 'x'"),
    ("skew", "{mixed: 'false'}", "dispatch.options: skew dispatcher: mixed must be true or false, got 'false'"),
    ("skew", "{mixed_order: ''}", "dispatch.options: skew dispatcher: mixed_order must be an order name or null, "
                                  "got ''"),
    ("skew", "{orders: {lpt: 1}}", "dispatch.options: skew dispatcher: orders must be a list of order names, "
                                   "got {'lpt': 1}"),
])
def test_dispatch_options_name_the_dispatcher_and_what_it_takes(tmp_path, name, options, message):
    with pytest.raises(ConfigError) as e:
        load_config(_file(tmp_path), 3, [f"dispatch.name={name}", f"dispatch.options={options}"])
    assert str(e.value) == f"--set dispatch.options={options}: {message}" or \
        str(e.value).startswith(f"--set dispatch.options={options}: {message}"), str(e.value)
    assert "<lambda>" not in str(e.value) and "\n" not in str(e.value)


def test_every_listed_dispatcher_option_is_taken_and_documented():
    from controller.scheduling import DISPATCHER_OPTIONS, DISPATCHERS, SkewDispatcher, make_dispatcher

    assert set(DISPATCHER_OPTIONS) == set(DISPATCHERS)
    defaults = {f.name: f.default for f in dataclasses.fields(SkewDispatcher)}
    defaults["order"] = "lpt"
    docs = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `dispatch.options`"))
    for name, takes in DISPATCHER_OPTIONS.items():
        make_dispatcher(name, **{k: defaults[k] for k in takes})  # each option it lists, it takes
        assert f"`{name}`" in docs, name
        for k in takes:
            assert f"`{k}`" in docs, (name, k)


# ---- 10: a task's own error is not blamed on its kwargs ----------------------------------------
USER_TASKS = '''
import json
from workers.types import TaskPrompt


class MathTask:
    def __init__(self, path: str, n: int = 5):
        self.items = [TaskPrompt(prompt=f"{i} + {i}", answer=str(2 * i)) for i in range(n)]

    def prompts(self, split):
        return self.items

    def score(self, prompt, completion):
        return float(prompt.answer in completion)


class JsonTask(MathTask):
    def __init__(self, path: str):
        self.rows = json.loads("{not json")


def build(path: str, **extra):
    raise KeyError("question")
'''


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    (tmp_path / "my_rl").mkdir()
    (tmp_path / "my_rl" / "tasks.py").write_text(USER_TASKS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_an_error_inside_a_user_task_is_its_own(user_tasks):
    line = USER_TASKS.splitlines().index(next(x for x in USER_TASKS.splitlines() if "TaskPrompt(prompt=" in x)) + 1
    with pytest.raises(ValueError) as e:
        make_task("my_rl/tasks.py:MathTask", n=5, path="data/math.jsonl")
    msg = str(e.value)
    assert "task.kwargs [" not in msg and "\n" not in msg, msg
    assert msg.startswith("task 'my_rl/tasks.py:MathTask': MathTask(...) raised TypeError: TaskPrompt.__init__() "
                          "missing 1 required positional argument: 'task' (at my_rl/tasks.py:"), msg
    assert re.search(rf"my_rl/tasks.py:{line} in ", msg), msg
    with pytest.raises(ValueError) as e:  # raised in a library the task calls: both places
        make_task("my_rl/tasks.py:JsonTask", path="x")
    msg = str(e.value)
    assert msg.startswith("task 'my_rl/tasks.py:JsonTask': JsonTask(...) raised JSONDecodeError: "), msg
    assert "json/decoder.py" in msg and "called from my_rl/tasks.py:" in msg and "in __init__)" in msg, msg
    with pytest.raises(ValueError, match=r"^task 'my_rl/tasks.py:build': build\(...\) raised KeyError: 'question' "
                                         r"\(at my_rl/tasks.py:\d+ in build\)$"):
        make_task("my_rl/tasks.py:build", path="x", anything=1)  # **extra: any kwargs bind


def test_bad_kwargs_are_checked_against_the_signature(user_tasks):
    with pytest.raises(ValueError) as e:
        make_task("my_rl/tasks.py:MathTask", n=5, pth="data/math.jsonl")
    assert str(e.value) == ("task 'my_rl/tasks.py:MathTask': task.kwargs ['n', 'pth']: MathTask.__init__() got an "
                            "unexpected keyword argument 'pth' (did you mean 'path'?); missing required argument(s) "
                            "['path'] (it takes path, n)"), str(e.value)
    with pytest.raises(ValueError, match=r"^task 'jsonl': task.kwargs \['train_files'\]: FileTask.__init__\(\) got "
                                         r"an unexpected keyword argument 'train_files'"):
        make_task("jsonl", train_files="x.jsonl")
    with pytest.raises(ValueError, match=r"^task.kwargs.kind: 'nope' is not one of"):  # a registered task's own message
        make_task("synthetic", kind="nope")


def test_docs_say_what_a_task_prompt_needs():
    text = DOCS.read_text()
    section = text[text.index("## Your own task"):]
    for field in ("`prompt`", "`answer`", "`task`", "`meta`", "`messages`", "`raw_answer`"):
        assert field in section, field
    assert 'TaskPrompt(prompt="What is 2 + 3?", answer="5", task="math")' in section


# ---- 11: the --set blame echoes what was typed ---------------------------------------------------
@pytest.mark.parametrize("sets", [
    ["placement.rpc_timeout_s=.nan"],
    ["placement.colocated=null"],
    ["train.iterations=true"],
    ["train.iterations=0x0"],
    ["tokenizer.prompt_template=Q: {prompt}"],
    ["train.iterations=3", "pipeline.mode=colocated"],  # a rule over several keys
    ["trainer.betas=[0.9,  1.0]"],
    ["train.iterations=5", "train={iterations: -1}"],  # the section set later holds the bad value (review, s55)
])
def test_the_set_blame_is_what_was_typed(tmp_path, sets):
    with pytest.raises(ConfigError) as e:
        load_config(_file(tmp_path), 3, sets)
    assert str(e.value).startswith(f"--set {sets[-1]}: "), str(e.value)


def test_a_mapping_of_overrides_is_echoed_as_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set placement.rpc_timeout_s=\.nan: "):
        load_config(_file(tmp_path), 3, {"placement.rpc_timeout_s": float("nan")})
    with pytest.raises(ConfigError, match=r"^--set placement.colocated=null: "):
        load_config(_file(tmp_path), 3, {"placement.colocated": None})
    with pytest.raises(ConfigError, match=r"^--set tokenizer.prompt_template=\{Q: \{prompt: null\}\}: "):
        load_config(_file(tmp_path), 3, {"tokenizer.prompt_template": {"Q": {"prompt": None}}})


def test_main_echoes_the_set_as_typed(tmp_path, monkeypatch, capsys):
    from controller.main import main

    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "t",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():  # nothing listens there
        monkeypatch.setenv(k, v)
    assert main(["--config", str(_file(tmp_path)), "--set", "train.iterations=3",
                 "--set", "placement.rpc_timeout_s=.nan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["config error: --set placement.rpc_timeout_s=.nan: placement.rpc_timeout_s: expected a finite "
                   "number, got nan"], err


# ---- 13: a --set value that is not YAML: quoting advice only for a string key -------------------
@pytest.mark.parametrize("text, advice", [
    ("train.batch_prompts=[1", "; train.batch_prompts takes an int (e.g. 3)"),
    ("train.iterations=[1", "; train.iterations takes an int or null"),  # null: 20, or train.epochs derives it
    ("train.temperature={0.5", "; train.temperature takes a number (e.g. 0.5)"),
    ("placement.colocated=[x", "; placement.colocated takes true or false"),
    ("placement.generation=[1, 2", "; placement.generation takes a list (e.g. [1, 2])"),
    ("train.ckpt_keep=[3", "; train.ckpt_keep takes an int or null"),
    ("trainer.betas=[0.9, 0.99", "; trainer.betas takes a list of 2 numbers (e.g. [0.9, 0.999])"),
    ("engine.eos_ids=[1, 2", "; engine.eos_ids takes a list of ints or null"),
    ("weight_sync.bucket_mb={4", "; if it is a string, quote it"),  # a section its owner reads
    ("train={iterations: [1", "; train takes a mapping (e.g. {key: value})"),
    ("tokenizer.prompt_template=A: {x}: {prompt}", "; quote it as a YAML string: "
                                                   "--set \"tokenizer.prompt_template='...'\""),
    ("task.name=a: b: c", "; quote it as a YAML string: --set \"task.name='...'\""),
    ("topology.default_datacenter=[a", "; if it is a string, quote it as a YAML string"),
    ("task.kwargs.prompt_key=a: b: c", "; if it is a string, quote it as a YAML string: "
                                       "--set \"task.kwargs.prompt_key='...'\""),
])
def test_advice_for_a_value_that_is_not_yaml_follows_the_key_type(text, advice):
    with pytest.raises(ConfigError) as e:
        parse_override(text)
    msg = str(e.value)
    assert msg.startswith(f"--set {text}: the value is not valid YAML (") and "\n" not in msg, msg
    assert advice in msg, msg
    if "quote" not in advice:
        assert "quote" not in msg, msg


@pytest.mark.parametrize("text, message", [
    ("train.iteratons=[1", "--set train.iteratons=[1: train.iteratons: unknown key; did you mean 'iterations'? "
                           "(known: ["),
    ("trian.iterations=[1", "--set trian.iterations=[1: trian: unknown section; did you mean 'train'? (known: ["),
    ("engine.max_batch=[1", "--set engine.max_batch=[1: engine.max_batch: unknown key; did you mean "
                            "'max_batch_size'?"),
])
def test_a_value_that_is_not_yaml_for_an_unknown_key_is_the_unknown_key_error(text, message):
    with pytest.raises(ConfigError) as e:
        parse_override(text)
    assert str(e.value).startswith(message), str(e.value)


def test_a_list_for_a_number_key_gets_no_quoting_advice(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_file(tmp_path), 3, ["train.iterations=[1]"])
    assert str(e.value) == "--set train.iterations=[1]: train.iterations: expected int, got list [1]", str(e.value)
    with pytest.raises(ConfigError, match=r"expected str, got dict .*put it in YAML quotes"):  # a string key: quote
        load_config(_file(tmp_path), 3, ["tokenizer.prompt_template=Q: {prompt}"])


@pytest.mark.parametrize("argv, why", [
    (["--config", "c.yaml", "--threads", "0"], "--threads must be >= 1"),
    (["--join", "h:1", "--rpc-timeout", "-5"], "--rpc-timeout must be a number of seconds in (0, 536870.911]"),
    (["--join", "h:1", "--rpc-timeout", "nan"], "--rpc-timeout must be a number of seconds in (0, 536870.911]"),
    # torch RPC's timeouts are int32 milliseconds (x4 for a constructor): 600000 s wrapped negative
    (["--join", "h:1", "--rpc-timeout", "600000"], "(torch RPC keeps milliseconds in 32 bits), got 600000.0"),
])
def test_launcher_flags_are_checked(argv, why, capsys):
    """--threads 0 was a traceback from torch.set_num_threads; --rpc-timeout -5 was taken and
    the joiner failed later with "timed out after -5000ms"."""
    from controller.main import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_an_rpc_timeout_torch_cannot_keep_is_refused():
    """placement.rpc_timeout_s 600000 (a week, as "no timeout") was taken, then the model bootstrap's
    call failed at once: 'RPC ran for more than set timeout (-2147483648 ms)'."""
    with pytest.raises(ConfigError, match=re.escape("placement.rpc_timeout_s must be in (0, 536870.911]")):
        load_config("configs/quickstart.yaml", overrides=["placement.rpc_timeout_s=600000"])
    assert load_config("configs/quickstart.yaml", overrides=["placement.rpc_timeout_s=536870"]).placement.rpc_timeout_s


@pytest.mark.parametrize("key, said", [
    ("train.critic_warmup=1", "verl's 'critic_warmup' is trainer.critic_warmup"),
    ("train.val_only=true", "verl's 'val_only' is train.eval_only"),
    # keys of verl's own GRPO / DAPO scripts
    ("trainer.use_remove_padding=true", "verl's 'use_remove_padding' has no key here: nothing to set"),
    ("trainer.use_fused_kernels=true", "verl's 'use_fused_kernels' has no key here: nothing to set"),
    ("engine.tensor_model_parallel_size=2", "verl's 'tensor_model_parallel_size' has no key here: no tensor"),
    ("trainer.fsdp_config={}", "verl's 'fsdp_config' has no key here: no FSDP"),
    ("trainer.optim={lr: 1e-6}", "verl's 'optim' has no key here: trainer.lr, trainer.weight_decay"),
    ("trainer.reward_manager=dapo", "dapo is trainer.overlong_buffer and trainer.overlong_penalty"),
    ("trainer.filter_groups={enable: true, metric: acc}", "verl's filter_groups section is flat keys here: "
                                                          "trainer.filter_groups: true (enable), trainer.max_gen_batches"),
    ("trainer.overlong_buffer={enable: true, len: 4}", "verl's overlong_buffer section is flat keys here: "
                                                       "trainer.overlong_buffer: LEN"),
    ("trainer.balance_batch=true", "verl's 'balance_batch' is pipeline.balance_batch (default off) here"),
    ("trainer.resume_from_path=x", "verl's 'resume_from_path' is the --resume DIR flag"),
    ("trainer.del_local_ckpt_after_load=true", "verl's 'del_local_ckpt_after_load' is train.ckpt_keep"),
    ("trainer.rollout_data_dir=x", "verl's 'rollout_data_dir' is logging.rollout_data_dir"),
    ("train.log_val_generations=4", "verl's 'log_val_generations' is logging.log_val_generations"),
])
def test_verls_trainer_keys_are_named(key, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config("configs/quickstart.yaml", overrides=[key])


@pytest.mark.parametrize("key, said", [
    ("train.lr=0.1", "train.lr: unknown key; 'lr' is a key of another section: trainer.lr"),
    ("trainer.iterations=3", "trainer.iterations: unknown key; 'iterations' is a key of another section: "
                             "train.iterations"),
    ("engine.temperature=1.0", "'temperature' is a key of another section: trainer.temperature or train.temperature"),
    ("trainer.max_tokens=8", "'max_tokens' is a key of another section: train.max_tokens"),
    ("pipeline.bucket_mb=8", "'bucket_mb' is a key of another section: weight_sync.bucket_mb"),
])
def test_a_key_in_the_wrong_section_names_its_section(key, said, tmp_path):
    """Only 'unknown key (known: [...])' was said (review, session 50), in a file and in a --set."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config("configs/quickstart.yaml", overrides=[key])
    section, rest = key.split(".", 1)
    name, value = rest.split("=")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(tmp_path / "c.yaml")


def test_one_folder_for_rollouts_and_evaluations_is_refused(tmp_path):
    """Both write ``<iteration>.jsonl``: an evaluation's generations replaced that iteration's
    scored samples (also as ``./x`` and ``x``)."""
    with pytest.raises(ConfigError, match=r"logging\.validation_data_dir: the same folder as logging\.rollout_data_dir"):
        load_config(_file(tmp_path, logging={"rollout_data_dir": "out/x", "validation_data_dir": "./out/x"}), 3)
    cfg = load_config(_file(tmp_path, logging={"rollout_data_dir": "out/x", "validation_data_dir": "out/y"}), 3)
    assert (cfg.logging.rollout_data_dir, cfg.logging.validation_data_dir) == ("out/x", "out/y")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match=r"logging\.validation_data_dir: the same folder"):
        load_config(_file(tmp_path, logging={"rollout_data_dir": str(tmp_path / "real"),
                                             "validation_data_dir": str(tmp_path / "link")}), 3)
    assert load_config(_file(tmp_path, logging={"rollout_data_dir": "."}), 3).logging.rollout_data_dir == "."
