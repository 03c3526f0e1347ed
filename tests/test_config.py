"""Config loading: YAML -> typed, validated dataclasses; every error names its key."""
import dataclasses

import pytest
import yaml

from controller.config import ConfigError, PipelineSection, from_dict, load_config
from controller.config_overrides import parse_override
from controller.modes import MODES


def _cfg(**sections):
    base = {"placement": {"generation": [1], "trainer": [2]}}
    base.update(sections)
    return base


def test_quickstart_loads_into_owner_classes():
    cfg = load_config("configs/quickstart.yaml", world_size=3)
    assert type(cfg.engine).__name__ == "EngineConfig" and cfg.engine.max_batch_size == 64
    assert type(cfg.trainer).__name__ == "TrainerConfig" and cfg.trainer.algorithm == "grpo"
    assert type(cfg.topology).__name__ == "Topology"
    assert cfg.pipeline.mode == "async_stream" and cfg.world_ranks == 3 and cfg.train.iterations == 120
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.iterations = 3
    assert cfg.train.iterations == 120  # unchanged


@pytest.mark.parametrize("d, key", [
    ({"train": {"iterationz": 3}}, "train.iterationz"),
    ({"train": {"iterations": "ten"}}, "train.iterations"),
    ({"train": {"iterations": True}}, "train.iterations"),
    ({"pipeline": {"mode": "turbo"}}, "pipeline.mode"),
    ({"pipeline": {"stream_window_s": -1}}, "pipeline.stream_window_s"),
    ({"bogus": {}}, "bogus"),
    ({"engine": {"max_batch": 3}}, "engine.max_batch"),
    ({"engine": {"max_batch_size": 0}}, "engine.max_batch_size"),
    ({"trainer": {"algorithm": "dpo"}}, "trainer.algorithm"),
    ({"placement": {"generation": [1], "trainer": [1]}}, "placement"),
    ({"placement": {"generation": [0], "trainer": [2]}}, "placement.generation[0]"),
    ({"train": {"batch_prompts": 0}}, "train.batch_prompts"),
    ({"train": {"group_size": 1}}, "train.group_size: grpo needs >= 2 samples per prompt"),
    ({"train": {"group_size": 1}, "trainer": {"algorithm": "rloo"}}, "train.group_size: rloo needs"),
    ({"train": {"group_size": 1}, "trainer": {"algorithm": "reinforce_plus_plus_baseline"}},
     "train.group_size: reinforce_plus_plus_baseline needs"),
    ({"task": {"name": "gsm8k"}}, "task.name: 'gsm8k' is not one of"),
    ({"dispatch": {"name": "lpt"}}, "dispatch.name: 'lpt' is not one of"),
    ({"engine": {"admission": "sjf"}}, "engine.admission: must be one of ('fcfs', 'lpt'), or module:fn"),
    ({"engine": {"admission": "no/such/keys.py:fn"}}, "engine.admission: no/such/keys.py (from 'no/such/keys.py:fn') "
                                                      "is not a file"),
    ({"engine": {"admission": "math:pi"}}, "engine.admission: 'math:pi' is a float, not a class or function"),
    ({"engine": {"admission": "os:getcwd"}}, "engine.admission 'os:getcwd' raised TypeError"),
    ({"engine": {"backend": "sglang"}}, "engine.backend: must be one of ('native', 'vllm'), or module:Name"),
    ({"engine": {"backend": "math:pi"}}, "engine.backend: 'math:pi' is a float, not a class or function"),
    ({"dispatch": {"name": "skew", "options": {"alphas": [1.5]}}}, "dispatch.options: skew dispatcher: every alpha"),
    ({"dispatch": {"name": "random", "options": {"order": "sjf"}}}, "dispatch.options: dispatcher order 'sjf'"),
    ({"dispatch": {"name": "random", "options": {"bogus": 1}}}, "dispatch.options: "),
    ({"ranker": {"update_every": -1}}, "ranker.update_every must be an int >= 0 (0: never), got -1"),
    ({"train": {"length_trace": "no/such/trace.jsonl.gz"}}, "train.length_trace: no/such/trace.jsonl.gz does not exist"),
    ({"train": {"length_scale": 0}}, "train.length_scale must be > 0"),
    ({"tokenizer": {"prompt_template": "Q: {question}"}},
     "tokenizer.prompt_template: 'Q: {question}' has the field(s) {question}"),
    ({"tokenizer": {"prompt_template": "Q:"}}, "tokenizer.prompt_template: 'Q:' must contain '{prompt}'"),
    ({"tokenizer": {"path": "x"}}, "tokenizer.path: unknown key"),
    ({"ranker": {"bootstrap_prompts": 1}}, "ranker.bootstrap_prompts must be an int >= 2"),
    ({"ranker": {"options": [1]}}, "ranker.options: expected dict"),
    ({"task": {"kwargs": {True: 3}}}, "task.kwargs: key True (bool) is not a name"),  # YAML's bare `on:`
    ({"dispatch": {"options": {1: 2}}}, "dispatch.options: key 1 (int) is not a name"),
    ({"ranker": {"options": {False: 2}}}, "ranker.options: key False (bool)"),
    ({"placement": {"elastic": False, "force_scale_out_at": 2}},
     "placement.force_scale_out_at: 2 adds a joining generation instance, but placement.elastic is false"),
    ({"ranker": {"kind": "lgbm"}}, "ranker.path: kind 'lgbm' loads a trained ranker folder"),
    ({"weight_sync": {"bucket_mb": 0}}, "weight_sync.bucket_mb"),
    ({"weight_sync": {"tree_shape": "ring"}}, "weight_sync.tree_shape"),
    ({"weight_sync": {"buckets": 3}}, "weight_sync.buckets: unknown key; did you mean 'bucket_mb'?"),
    ({"weight_sync": {"topology": {}}}, "weight_sync.topology: a run's topology is the top-level"),
])
def test_bad_values_name_the_key(d, key):
    with pytest.raises(ConfigError) as e:
        from_dict(_cfg(**d), world_size=3)
    assert key in str(e.value)


def test_fewer_prompts_than_trainer_ranks_is_refused():
    """A trainer rank would get no prompt group every iteration (it once hung in step(); now it
    all-reduces zeros, tests/test_pipeline_modes_equivalence.py): refused at load."""
    two = {"placement": {"generation": [1], "trainer": [2, 3]}}
    with pytest.raises(ConfigError) as e:
        from_dict({**two, "train": {"batch_prompts": 1}}, world_size=4)
    assert str(e.value).startswith("train.batch_prompts: 1 prompts an iteration cannot feed the 2 trainer ranks "
                                   "of placement.trainer [2, 3]")
    assert from_dict({**two, "train": {"batch_prompts": 2}}, world_size=4).train.batch_prompts == 2


def test_weight_sync_section_takes_the_run_topology():
    topo = {"datacenters": {"a": [0, 1], "b": [2]}}
    cfg = from_dict(_cfg(topology=topo, weight_sync={"bucket_mb": 0.5, "tree_shape": "binary"}), 3)
    assert cfg.weight_sync.bucket_bytes == 500_000 and cfg.weight_sync.tree_shape == "binary"
    assert cfg.weight_sync.topology is cfg.topology and cfg.topology.dc(2) == "b"
    plan = cfg.weight_sync.plan([2], [1], [("w", (4,), "float32")])
    assert plan.kind == "tree" and plan.senders == (2,)
    default = from_dict(_cfg(), 3).weight_sync
    assert default.bucket_bytes == 4_000_000 and default.tree_shape == "chain" and not default.naive
    assert from_dict(_cfg(weight_sync={"bucket_mb": 4.1}), 3).weight_sync.bucket_bytes == 4_100_000  # not 4,099,999


def test_more_ranks_than_world_is_an_error():
    with pytest.raises(ConfigError, match=r"placement.trainer\[0\]: rank 5 >= world size 3"):
        from_dict(_cfg(placement={"generation": [1], "trainer": [5]}), world_size=3)
    from_dict(_cfg(placement={"generation": [1, 2, 3, 4], "trainer": [5]}))  # world unknown: fine


def test_engine_eos_ids_is_refused_in_a_run_config():
    # accepted, then replaced by the model folder's stop ids before any engine saw it
    with pytest.raises(ConfigError, match=r"engine.eos_ids: a run stops on its model folder's ids .*"
                                          r"generation_config.json and leave engine.eos_ids out"):
        from_dict(_cfg(engine={"eos_ids": [99999]}))


def test_a_colocated_run_is_static():
    """A joiner in a colocated run held no trainer to take the weights from: adding it ended the run."""
    both = {"generation": [1, 2], "trainer": [1, 2]}
    assert not from_dict(_cfg(pipeline={"mode": "colocated"}, placement=both), 3).placement.elastic
    with pytest.raises(ConfigError, match=r"placement.elastic: true cannot be used with pipeline.mode: colocated"):
        from_dict(_cfg(pipeline={"mode": "colocated"}, placement={**both, "elastic": True}), 3)
    assert from_dict(_cfg(), 3).placement.elastic  # disaggregated: elastic by default


def test_colocated_needs_same_ranks():
    ok = from_dict(_cfg(pipeline={"mode": "colocated"}, placement={"generation": [1, 2], "trainer": [1, 2]}), 3)
    assert ok.pipeline.mode == "colocated"
    with pytest.raises(ConfigError, match="colocated"):
        from_dict(_cfg(pipeline={"mode": "colocated"}), 3)
    same = {"generation": [1], "trainer": [1], "colocated": True}
    assert from_dict(_cfg(pipeline={"mode": "colocated"}, placement=same), 2).placement.colocated
    # with another mode the run overlapped both stages in one process on one-step-old weights
    with pytest.raises(ConfigError, match=r"placement.colocated: true .* not 'async_stream'; set pipeline.mode: colocated"):
        from_dict(_cfg(pipeline={"mode": "async_stream"}, placement=same), 2)


def test_overrides_and_file_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_cfg()))
    cfg = load_config(p, 3, dict([parse_override("train.iterations=7"), parse_override("pipeline.mode=stream")]))
    assert cfg.train.iterations == 7 and cfg.pipeline.mode == "stream"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    p.write_text("train: [unclosed")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)
    # one line naming the file and the line (PyYAML's own text spans lines, naming "<unicode string>")
    p.write_text("train:\n  iterations: 3\n  batch_prompts: [4\nlogging:\n  logdir: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == (f"{p}:4:8: invalid YAML: while parsing a flow sequence (line 3); expected ',' or ']', "
                            "but got ':'")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("train.iterations")
    p.write_text(yaml.safe_dump(_cfg()))
    with pytest.raises(ConfigError, match=r"^--set trian.iterations=3: trian: unknown section"):
        load_config(p, 3, {"trian.iterations": 3})
    with pytest.raises(ConfigError, match=r"^--set train.iterations=0: train.iterations must be an int >= 1"):
        load_config(p, 3, {"train.iterations": 0})
    bad = _cfg(train={"iterations": 0})
    p.write_text(yaml.safe_dump(bad))  # the file's own bad value, beside an unrelated override
    with pytest.raises(ConfigError, match=r"c.yaml: train.iterations must be an int >= 1"):
        load_config(p, 3, {"pipeline.mode": "stream"})


def test_every_mode_is_a_registered_strategy():
    assert set(MODES) == {"colocated", "batch", "minibatch", "stream", "async_batch", "async_stream"}
    for name, m in MODES.items():
        PipelineSection(mode=name)
        assert m.max_staleness == (1 if name.startswith("async") else 0)
        assert m.release in ("all", "minibatch", "stream")


RUN_CONFIGS = [p for p in sorted(__import__("glob").glob("configs/*.yaml"))
               if "placement" in (yaml.safe_load(open(p)) or {})]  # (planner cluster files live there too)


@pytest.mark.parametrize("path", RUN_CONFIGS)
def test_every_shipped_run_config_loads(path):
    cfg = load_config(path)
    assert cfg.world_ranks >= 3


def test_trainer_takes_log_probs_at_the_rollout_temperature():
    from controller.config import from_dict

    assert from_dict({"train": {"temperature": 0.7}}).trainer.temperature == 0.7
    assert from_dict({}).trainer.temperature == 1.0
    assert from_dict({"train": {"temperature": 0.0}, "trainer": {"algorithm": "ppo"}}).trainer.temperature == 1.0  # greedy: T = 1
    assert from_dict({"train": {"temperature": 0.7}, "trainer": {"temperature": 0.7}}).trainer.temperature == 0.7
    with pytest.raises(ConfigError, match="trainer.temperature: 0.5 differs from the rollout's train.temperature 0.7"):
        from_dict({"train": {"temperature": 0.7}, "trainer": {"temperature": 0.5}})


@pytest.mark.parametrize("d, message", [
    ({"trainer": {"entropy_coeff": 0.01}}, "trainer.entropy_coeff: unknown key; verl's 'entropy_coeff' is trainer.entropy_coef"),
    ({"trainer": {"entropy_coe": 0.01}}, "trainer.entropy_coe: unknown key; did you mean 'entropy_coef'?"),
    ({"train": {"iteration": 3}}, "train.iteration: unknown key; did you mean 'iterations'?"),
    ({"trainer": {"kl_loss_coef": 0.1}}, "trainer.kl_loss_coef: unknown key; verl's 'kl_loss_coef' is trainer.kl_coef"),
    ({"data": {"train_files": "x"}}, r"data: unknown section; verl's 'data' is task \(the dataset\)"),
    ({"trainer": {"zzz": 1}}, r"trainer.zzz: unknown key \(known:"),
    # near misses that pointed elsewhere (new-user audit, session 18): total_epochs -> total_steps
    # (the LR schedule's length), warmup_style -> warmup_steps
    ({"trainer": {"total_epochs": 3}}, "trainer.total_epochs: unknown key; verl's 'total_epochs' is train.epochs here"),
    ({"trainer": {"lr_warmup_steps_ratio": 0.1}}, "verl's 'lr_warmup_steps_ratio' is trainer.warmup_ratio here"),
    ({"train": {"truncation": "left"}}, "verl's 'truncation' is train.overlong_prompts: truncate_left / truncate_right"),
    ({"trainer": {"warmup_style": "cosine"}}, "verl's 'warmup_style' is trainer.lr_schedule here"),
    ({"trainer": {"clip_ratio_high": 0.28}}, "verl's 'clip_ratio_high' is trainer.clip_high here"),
    ({"train": {"filter_overlong_prompts": True}}, "verl's 'filter_overlong_prompts' is train.overlong_prompts: skip"),
    ({"train": {"overlong_prompts": True}}, r"train.overlong_prompts: True is not one of \('error', 'skip', "
                                            r"'truncate_left', 'truncate_right', 'truncate_middle'\)"),
])
def test_unknown_keys_suggest_the_name(d, message):
    from controller.config import from_dict

    with pytest.raises(ConfigError, match=message):
        from_dict(d)


def test_lr_schedule_length_follows_the_run():
    from controller.config import from_dict

    assert from_dict({"train": {"iterations": 40}}).trainer.total_steps == 40
    assert from_dict({"train": {"iterations": 40}, "trainer": {"total_steps": 100}}).trainer.total_steps == 100
    with pytest.raises(ConfigError, match=r"warmup_steps \(10\) must be <= trainer.total_steps \(5\).*follows "
                                          r"train.iterations = 5 unless set"):
        from_dict({"train": {"iterations": 5}, "trainer": {"warmup_steps": 10}})
    # checked against the length the schedule will have, not the default 1,000 it had before
    # following train.iterations (a 3,000-iteration run with 1,500 warmup steps was refused)
    long = from_dict({"train": {"iterations": 3000}, "trainer": {"warmup_steps": 1500}}).trainer
    assert (long.total_steps, long.warmup_steps) == (3000, 1500)


@pytest.mark.parametrize("sets, message", [
    (["train.epochs=2", "train.iterations=5"],
     "train.iterations (5) and train.epochs (2) both set the run's length; set one"),
    (["train.epochs=0"], "--set train.epochs=0: train.epochs must be an int >= 1 (null: train.iterations sets the "
                         "length), got 0"),
    (["trainer.warmup_ratio=0.1", "trainer.warmup_steps=2"],
     "trainer.warmup_steps (2) and trainer.warmup_ratio (0.1) both set the LR warmup; set one"),
    (["trainer.warmup_ratio=1"], "--set trainer.warmup_ratio=1: trainer.warmup_ratio must be in [0, 1) (0: "
                                 "warmup_steps says), got 1.0"),
    (["train.overlong_prompts=truncate_middle"], "--set train.overlong_prompts=truncate_middle: "
     "train.overlong_prompts: truncate_middle cuts prompts to train.max_prompt_tokens, which is 0 (no limit); set it"),
])
def test_verls_epochs_warmup_ratio_and_truncation_are_refused_with_what_conflicts(tmp_path, sets, message):
    with pytest.raises(ConfigError) as e:
        _load_with(tmp_path, *sets)
    assert message in str(e.value), str(e.value)


def test_warmup_ratio_follows_the_schedules_length():
    from controller.config import from_dict

    t = from_dict({"train": {"iterations": 40}, "trainer": {"warmup_ratio": 0.1}}).trainer
    assert (t.total_steps, t.warmup, t.warmup_steps) == (40, 4, 0)
    t = from_dict({"train": {"iterations": 40}, "trainer": {"warmup_ratio": 0.1, "total_steps": 95}}).trainer
    assert t.warmup == 9  # int(9.5): verl rounds down


def test_rollout_filters_make_the_trainer_recompute_old_log_probs():
    from controller.config import from_dict

    assert from_dict({}).trainer.recompute_old_logprobs is False
    assert from_dict({"train": {"top_p": 0.9}}).trainer.recompute_old_logprobs is True
    assert from_dict({"train": {"top_k": 20}}).trainer.recompute_old_logprobs is True
    with pytest.raises(ConfigError, match="trainer.recompute_old_logprobs: must be true with train.top_k"):
        from_dict({"train": {"top_p": 0.9}, "trainer": {"recompute_old_logprobs": False}})
    for bad, msg in (({"top_p": 0.0}, "train.top_p must be in"), ({"top_k": -2}, "train.top_k must be an int >= -1")):
        with pytest.raises(ConfigError, match=msg):
            from_dict({"train": bad})


def test_greedy_group_algorithms_and_eval_prompts_are_checked():
    from controller.config import from_dict

    with pytest.raises(ConfigError, match="train.temperature: grpo with greedy sampling"):
        from_dict({"train": {"temperature": 0.0}, "trainer": {"algorithm": "grpo"}})
    assert from_dict({"train": {"temperature": 0.0}, "trainer": {"algorithm": "ppo"}}).train.temperature == 0.0
    with pytest.raises(ConfigError, match="train.eval_prompts must be an int >= 0"):
        from_dict({"train": {"eval_prompts": -1}})


def test_eval_sampling_is_checked():
    from controller.config import from_dict

    assert from_dict({"train": {"eval_samples": 4, "eval_temperature": 0.6}}).train.eval_samples == 4
    with pytest.raises(ConfigError, match="train.eval_samples: 4 greedy samples"):
        from_dict({"train": {"eval_samples": 4}})
    with pytest.raises(ConfigError, match="train.eval_samples must be an int >= 1"):
        from_dict({"train": {"eval_samples": 0}})


def test_verl_top_k_minus_one_is_off():
    from controller.config import from_dict

    cfg = from_dict({"train": {"top_k": -1}})
    assert cfg.train.top_k == -1 and cfg.trainer.recompute_old_logprobs is False


# ---- audit of bad values: each is one ConfigError naming its key, at load ---------------------
def _load_with(tmp_path, *sets, **sections):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(_cfg(**sections)))
    return load_config(p, 3, dict(parse_override(s) for s in sets))


def test_a_planner_cluster_file_given_as_a_run_config_is_named():
    with pytest.raises(ConfigError, match=r"name: unknown section .*\(a planner cluster file: python -m "
                                          r"controller.planner plan --cluster FILE, docs/planner.md\)"):
        load_config("configs/plan_cluster_h800.yaml")



def test_reinforce_plus_plus_samples_one_per_prompt():
    """REINFORCE++ compares each sample with the whole batch (whitening), not with its group:
    one sample a prompt is its usual setting."""
    cfg = from_dict({"train": {"group_size": 1}, "trainer": {"algorithm": "reinforce_plus_plus"}})
    assert cfg.train.group_size == 1 and cfg.trainer.whiten and not cfg.trainer.grouped
