"""Config errors that name their origin: a ``--set`` override that is not YAML or breaks a
rule (over one key or several) is named in the message; every numeric key has a range;
max_staleness must cover the mode's lag; main() prints a bad --set in one line."""
import re

import pytest
import yaml
from test_config import _cfg, _load_with

from controller.config import ConfigError, from_dict
from controller.config_overrides import parse_override
from controller.modes import MODES
from workers.config_schema import field_range


@pytest.mark.parametrize("sets, message", [
    (["train.eval_every=-1"], "train.eval_every must be an int >= 0 (0: never), got -1"),
    (["train.ckpt_every=-1"], "train.ckpt_every must be an int >= 0 (0: only at the end), got -1"),
    (["logging.timeline_every=-1"], "logging.timeline_every must be an int >= 0 (0: never), got -1"),
    (["train.sft_steps=-5"], "train.sft_steps must be an int >= 0, got -5"),
    (["train.sft_lr=0"], "train.sft_lr must be > 0, got 0.0"),
    (["placement.rpc_timeout_s=.nan"], "placement.rpc_timeout_s: expected a finite number, got nan"),
    (["placement.rpc_timeout_s=.inf"], "placement.rpc_timeout_s: expected a finite number, got inf"),
    (["placement.rpc_timeout_s=0"], "placement.rpc_timeout_s must be in (0, 536870.911] (seconds; torch RPC"),
    (["train.temperature=.nan"], "train.temperature: expected a finite number, got nan"),
    (["train.temperature=-1", "trainer.algorithm=ppo"],
     "train.temperature must be in [0, 2.0] (below 1e-05: greedy; sampled from 0.01, as both engines serve), "
     "got -1.0"),
    (["train.temperature=2.5"], "train.temperature must be in [0, 2.0]"),  # vLLM refuses T > 2
    (["train.eval_temperature=0.005"],  # vLLM would sample it at 0.01: no engine serves it
     "train.eval_temperature must be below 1e-05 (greedy) or in [0.01, 2], got 0.005"),
    (["trainer.kl_coef=.nan"], "trainer.kl_coef: expected a finite number, got nan"),
    (["trainer.min_lr_ratio=1.5"], "trainer.min_lr_ratio must be in [0, 1] (the fraction of lr the schedule decays "
                                   "to), got 1.5"),
    (["train.seed=-1"], "train.seed must be an int in [0, 4294967296), got -1"),
    (["engine.seed=-3"], "engine.seed must be an int in [0, 4294967296), got -3"),
    (["trainer.betas=[0.9]"], "trainer.betas: expected 2 values, got 1: [0.9]"),
    (["trainer.betas=[0.9, 1.0]"], "trainer.betas[1] must be in [0, 1), got 1.0"),
    (["trainer.betas=[0.9, x]"], "trainer.betas[1]: expected float, got str 'x'"),
    (["ranker.kind=lgmb", "ranker.path=r"], "ranker.kind: 'lgmb' is not one of ['none', 'ensemble', 'lgbm', 'lm']"),
    (["trainer.max_staleness=0"], "trainer.max_staleness: 0 is below the lag of pipeline.mode async_stream (1:"),
    (["train.min_tokens=20"], "train.min_tokens must be <= train.max_tokens (16), got 20"),
    (['tokenizer.prompt_template=\'Reply as JSON {"answer": N}. Q: {prompt}\''],
     "tokenizer.prompt_template: 'Reply as JSON {\"answer\": N}. Q: {prompt}' has the field(s) {\"answer\"}, but only "
     "{prompt} is filled in (it is a str.format template); write literal braces as {{ and }}"),
    (["tokenizer.prompt_template=Q: {prompt}"], "tokenizer.prompt_template: expected str, got dict {'Q': {'prompt': "
                                                "None}} (YAML read the value as a mapping or a list"),
])
def test_audited_bad_values_name_their_key_and_the_set(tmp_path, sets, message):
    with pytest.raises(ConfigError) as e:
        _load_with(tmp_path, *sets)
    # named against the --set that gave the value (the first: its key leads the message)
    assert str(e.value).startswith("--set " + sets[0].replace("'", "").split("=")[0]), str(e.value)
    assert message in str(e.value), str(e.value)


def test_every_numeric_key_has_a_range():
    """A new int / float key of a run section declares its valid values next to it (``ranged``,
    or an explicit check): an unranged key would take any value, as -1 meant "every iteration"
    before."""
    import typing

    from controller import config as C

    for cls, section in ((C.PipelineSection, "pipeline"), (C.RankerSection, "ranker"), (C.EngineConfig, "engine"),
                         (C.PlacementSection, "placement"), (C.TrainSection, "train"), (C.LoggingSection, "logging")):
        for name, hint in typing.get_type_hints(cls).items():
            if {int, float} & {hint, *typing.get_args(hint)}:
                assert field_range(cls, name) is not None, f"{section}.{name} has no range: ranged(default, Range(..))"
    # the edges of the ranges load (0: never, -1: off, greedy for ppo, beta1 0)
    cfg = from_dict(_cfg(train={"eval_every": 0, "ckpt_every": 0, "sft_steps": 0, "seed": 2**32 - 1, "top_k": -1,
                                "temperature": 0.0, "top_p": 1.0, "ckpt_keep": None},
                         trainer={"algorithm": "ppo", "betas": [0.0, 0.999]},
                         logging={"timeline_every": 0}, placement={"generation": [1], "trainer": [2],
                                                                    "force_scale_out_at": -1}), 3)
    assert cfg.trainer.betas == (0.0, 0.999) and cfg.train.seed == 2**32 - 1


def test_max_staleness_must_cover_the_mode_lag():
    for name, mode in MODES.items():
        placement = {"generation": [1], "trainer": [1]} if mode.colocated else {"generation": [1], "trainer": [2]}
        for staleness in (0, 1, 3):
            d = {"pipeline": {"mode": name}, "trainer": {"max_staleness": staleness}, "placement": placement}
            world = 2 if mode.colocated else 3  # a rank no role uses is refused
            if staleness >= mode.lag:
                assert from_dict(d, world).trainer.max_staleness == staleness
            else:
                with pytest.raises(ConfigError, match=rf"trainer.max_staleness: {staleness} is below the lag of "
                                                      rf"pipeline.mode {name} .*set trainer.max_staleness >= "
                                                      rf"{mode.lag}, or a pipeline.mode with lag <= 0 \(colocated, "
                                                      r"batch, minibatch, stream\)"):
                    from_dict(d, world)


def test_a_set_value_that_is_not_yaml_is_one_line():
    with pytest.raises(ConfigError) as e:
        parse_override('tokenizer.prompt_template=Reply as JSON {"answer": N}. Q: {prompt}')
    msg = str(e.value)
    assert msg.startswith('--set tokenizer.prompt_template=Reply as JSON {"answer": N}. Q: {prompt}: the value is '
                          "not valid YAML (mapping values are not allowed here at character 31); quote it"), msg
    assert "\n" not in msg


def test_a_set_value_whose_hash_yaml_would_drop_is_refused():
    # YAML reads " #..." as a comment: the run would get "ablation", not what was typed
    with pytest.raises(ConfigError, match=r"--set logging.experiment=ablation #2: .* comment, so the value would "
                                          r"be ablation; quote it"):
        parse_override("logging.experiment=ablation #2")
    assert parse_override('logging.experiment="ablation #2"') == ("logging.experiment", "ablation #2")
    assert parse_override("logging.experiment=a#2") == ("logging.experiment", "a#2")  # no space: not a comment
    assert parse_override("task.kwargs.files=[a, '#b']") == ("task.kwargs.files", ["a", "#b"])


def test_an_error_of_a_rule_over_several_keys_names_the_set_that_caused_it(tmp_path):
    with pytest.raises(ConfigError) as e:  # the file's placement is fine for its own mode
        _load_with(tmp_path, "pipeline.mode=colocated", "train.iterations=3")
    assert str(e.value) == ("--set pipeline.mode=colocated: placement: colocated needs generation == trainer ranks, "
                            "got [1] vs [2]; generation and training take turns on the same ranks: e.g. "
                            "placement.generation=[1] placement.trainer=[1] (2 processes)")
    with pytest.raises(ConfigError, match=r"c.yaml: placement: colocated needs"):  # the file's own pair
        _load_with(tmp_path, "train.iterations=3", pipeline={"mode": "colocated"})
    with pytest.raises(ConfigError, match=r"^--set pipeline.mode=async_stream: trainer.max_staleness: 0 is below"):
        _load_with(tmp_path, "train.iterations=3", "pipeline.mode=async_stream", pipeline={"mode": "batch"},
                   trainer={"max_staleness": 0})
    # two rules broken at once (each --set alone still fails on the other), the error naming the
    # section of a --set key: it was blamed on the file, which has no weight_sync section (review, s56)
    with pytest.raises(ConfigError, match=r"^--set weight_sync.bucket_mb=8: weight_sync: colocated"):
        _load_with(tmp_path, "pipeline.mode=colocated", "placement.trainer=[1]", "weight_sync.bucket_mb=8")
    # a bad value of the file's beside a valid --set of the same section: the file's (the section
    # match named the --set: the diff review, s56)
    with pytest.raises(ConfigError, match=r"c.yaml: train.iterations must be an int >= 1"):
        _load_with(tmp_path, "train.seed=3", train={"iterations": 0})


def test_main_says_a_bad_set_in_one_line(tmp_path, monkeypatch, capsys):
    # the ScannerError of a --set value came as a traceback from every rank
    from controller.main import main

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_cfg()))
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "t",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():  # nothing listens there
        monkeypatch.setenv(k, v)
    assert main(["--config", str(p), '--set=tokenizer.prompt_template=Reply as JSON {"answer": N}. Q: {prompt}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: --set tokenizer.prompt_template=Reply"), err


def test_a_config_error_found_after_load_names_the_set_behind_it(monkeypatch, capsys):
    # the task's data, the model folder, the engine on its rank are checked with the processes up:
    # their errors did not name the --set, as errors at load do (a user-journey review)
    from types import SimpleNamespace

    from controller import runner
    from controller.config_overrides import set_behind

    typed = "task.kwargs.files={train:a.jsonl,test:b.jsonl}"
    error = "task.kwargs.files: one path, or split -> one path"
    assert set_behind([typed, "train.iterations=3"], error) == f"--set {typed}"
    assert set_behind(["task.kwargs={files: x}"], error) == "--set task.kwargs={files: x}"  # a section above
    assert set_behind(["task.kwargs.filesx=1", "train.iterations=3"], error) == ""
    assert set_behind(None, error) == ""
    # a key below the one named, and the key an error's advice says to set (review, session 50)
    assert set_behind(["task.kwargs.files.test=h.jsonl"], "task.kwargs.files: test and val both name the test "
                      "split (a, b); keep one") == "--set task.kwargs.files.test=h.jsonl"
    assert set_behind(["logging.logdir=x", "task.kwargs.prompt_key=nokey"],
                      "task (jsonl) train prompts: d.jsonl:1: missing field 'nokey' (have ['q']; set "
                      "task.kwargs.prompt_key)") == "--set task.kwargs.prompt_key=nokey"
    assert set_behind(["task.kwargs.prompt=x"], "task (jsonl): ...; set task.kwargs.prompt_key") == ""

    def refuse(cfg, args, world_size):
        raise ConfigError(error)

    monkeypatch.setattr(runner, "Session", refuse)
    monkeypatch.setattr(runner, "config_notes", lambda cfg: [])
    args = SimpleNamespace(set=[typed], resume="")
    assert runner.run_controller(None, args, 1) == 2
    assert f"config error: --set {typed}: {error}\n" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["logging=null", "engine=", "trainer=~"])
def test_a_set_of_a_whole_section_to_null_is_refused(tmp_path, text):
    """It replaced the file's section with the defaults: `--set logging=null` wrote the run into
    runs/quickstart, `--set trainer=` reset lr (review, session 51)."""
    from controller.config import load_config

    section = text.split("=")[0]
    with pytest.raises(ConfigError, match=rf"--set {re.escape(text)}: {section}: is empty \(YAML null\); a --set of "
                                          rf"a whole section would replace the file's {section} section"):
        load_config("configs/quickstart.yaml", 3, [text])


def test_a_set_of_a_whole_section_to_a_mapping_takes_its_keys_over_the_files():
    """`--set 'train={iterations: 5}'` replaced the section: group_size, max_tokens, sft_steps
    went back to their defaults without a word (review, s53); OmegaConf merges, as here."""
    from controller.config import load_config

    base = load_config("configs/quickstart.yaml", 3)
    cfg = load_config("configs/quickstart.yaml", 3, ["train={iterations: 5}"])
    assert cfg.train.iterations == 5 and cfg.train.group_size == base.train.group_size
    assert (cfg.train.max_tokens, cfg.train.sft_steps) == (base.train.max_tokens, base.train.sft_steps)


def test_a_float_written_as_1e_5_is_a_float_in_every_mapping(tmp_path):
    """YAML 1.1 reads 1e-5 (no dot) as text: typed keys converted it, but model.init,
    task.kwargs, ranker.options and dispatch.options passed it on (review, s53)."""
    from controller.config import load_config

    p = tmp_path / "c.yaml"
    p.write_text("model:\n  init: {rms_norm_eps: 1e-5, rope_theta: 1e6}\n"
                 "dispatch:\n  name: skew\n  options: {noise: 1e-2}\nranker:\n  kind: lgbm\n"
                 f"  path: {tmp_path / 'ranker'}\n  options: {{learning_rate: 1e-2}}\n")
    cfg = load_config(p, 3)
    assert cfg.model.init == {"rms_norm_eps": 1e-5, "rope_theta": 1e6}
    assert cfg.dispatch.options == {"noise": 0.01} and cfg.ranker.options["learning_rate"] == 0.01
    assert load_config(p, 3, ["task.kwargs={demo_noise: 1e-1}"]).task.kwargs == {"demo_noise": 0.1}
    assert load_config(p, 3, ["task.kwargs={a: .5e3, b: 1.0e5}"]).task.kwargs == {"a": 500.0, "b": 1e5}


def test_a_set_is_blamed_only_when_the_config_loads_without_it(tmp_path):
    """A --set whose removal changed the error to another of the file's was named for the file's
    own bad value (review, s53)."""
    with pytest.raises(ConfigError, match=r"c.yaml: logging.timeline_every"):
        _load_with(tmp_path, "train.epochs=null", train={"iterations": 3, "epochs": 2},
                   logging={"timeline_every": -1})
    # two bad ones: neither alone is what fails; the one the error names is (review of the above)
    with pytest.raises(ConfigError, match=r"^--set train.epochs=2: train.iterations \(3\) and train.epochs \(2\)"):
        _load_with(tmp_path, "train.epochs=2", "logging.timeline_every=-1", train={"iterations": 3})


def test_the_rules_main_checks_name_the_set_and_a_top_level_list_is_one_error(tmp_path, monkeypatch, capsys):
    from controller.config import load_config
    from controller.main import main, parse_args

    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "t",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():  # nothing listens there
        monkeypatch.setenv(k, v)
    assert main(["--config", "configs/quickstart.yaml", "--set", "pipeline.minibatch_size=4"]) == 2
    assert "config error: --set pipeline.minibatch_size=4: pipeline.minibatch_size: 4 acts only" in capsys.readouterr().err
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml: config: expected a mapping at top level, got list"):
        load_config(p, 3, ["train.iterations=3"])  # (an AttributeError traceback with a --set)
    with pytest.raises(SystemExit):  # a torchrun rank's timeout is the config's: it was dropped
        parse_args(["--config", "c.yaml", "--rpc-timeout", "60"])
    assert "--set placement.rpc_timeout_s=60" in capsys.readouterr().err
    assert parse_args(["--join", "h:1"]).rpc_timeout == 300.0
