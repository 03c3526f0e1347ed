"""Config checks of a run's components at load, each error naming its key: dispatch (the profile
file, skew dispatch needs a ranker), tokenizer.prompt_template, the engine (device, backend,
cpu_prepack) and the ranker (options, the kind of a saved ranker)."""
import re

import pytest
from test_config import _cfg, _load_with

from controller.config import ConfigError, from_dict, load_config


def test_dispatch_profile_is_read_at_load(tmp_path):
    from controller.scheduling import PTLProfile

    with pytest.raises(ConfigError, match=r"^--set dispatch.profile=\S+nope.json: dispatch.profile: \S+nope.json "
                                          r"does not exist"):
        _load_with(tmp_path, f"dispatch.profile={tmp_path / 'nope.json'}")
    with pytest.raises(ConfigError, match=r"dispatch.profile: \S+ is a folder \(a saved PTLProfile JSON file"):
        _load_with(tmp_path, f"dispatch.profile={tmp_path}")  # it said "does not exist"
    bad = tmp_path / "bad.json"
    bad.write_text('{"ptl_s": [0.01]}')
    with pytest.raises(ConfigError, match=r"dispatch.profile: \S+bad.json: PTLProfile is missing \['batch_sizes', "
                                          r"'kv_tokens'\]"):
        _load_with(tmp_path, f"dispatch.profile={bad}")
    good = tmp_path / "good.json"
    PTLProfile([1, 4], [0.01, 0.02], 1024).save(good)
    assert _load_with(tmp_path, f"dispatch.profile={good}").dispatch.profile == str(good)


@pytest.mark.parametrize("template, message", [
    ('Reply as JSON {"answer": N}. Q: {prompt}', "has the field(s) {\"answer\"}, but only {prompt} is filled in"),
    ("{}: {prompt}", "has the field(s) {}, but only {prompt}"),
    ("Q: {prompt", "is not a str.format template (expected '}' before end of string); write literal braces as"),
    ("Q: {prompt} }", "is not a str.format template (Single '}' encountered in format string)"),
    ("{prompt:d}", "formatting {prompt} fails (Unknown format code 'd'"),
    ("Q: prompt", "must contain '{prompt}'"),
])
def test_prompt_template_is_formatted_at_load(template, message):
    with pytest.raises(ConfigError) as e:
        from_dict({"tokenizer": {"prompt_template": template}})
    assert str(e.value).startswith("tokenizer.prompt_template: ") and message in str(e.value), str(e.value)
    assert from_dict({"tokenizer": {"prompt_template": 'JSON {{"answer": N}}. Q: {prompt}'}}).tokenizer.prompt_template


def test_a_cuda_engine_without_cuda_on_its_rank_is_a_config_error(monkeypatch):
    from types import SimpleNamespace

    import torch.distributed.rpc as rpc

    from controller.world import check_engine
    from workers.generation import support
    from workers.generation.config import EngineConfig

    devices = {1: 0, 2: 1}

    def ask(to, fn, args, timeout):  # each rank answers for its own torch (hosts may differ)
        monkeypatch.setattr(support, "cuda_devices", lambda: devices[int(to.removeprefix("worker"))])
        return SimpleNamespace(wait=lambda answer=fn(*args): answer)

    monkeypatch.setattr(rpc, "rpc_async", ask)
    check_engine(EngineConfig(device="cpu"), [1], 5.0)
    check_engine(EngineConfig(device=""), [1], 5.0)
    check_engine(EngineConfig(device="cuda", attention_backend="torch"), [2], 5.0)
    with pytest.raises(ConfigError, match=r"^engine.device: 'cuda', but CUDA is not available on rank 1 "
                                          r"\(generation\); set engine.device: cpu, or \"\" to use CUDA when there "
                                          r"is a GPU$"):
        check_engine(EngineConfig(device="cuda"), [2, 1], 5.0)
    with pytest.raises(ConfigError, match=r"^engine.device: 'cuda:1', but rank 2 \(generation\) has 1 CUDA device"):
        check_engine(EngineConfig(device="cuda:1"), [2], 5.0)
    with pytest.raises(ValueError, match=r"^engine.device: must be '', 'cpu', 'cuda' or 'cuda:N', got 'cuda:x'"):
        EngineConfig(device="cuda:x")


def test_an_engine_its_rank_cannot_build_is_named_by_its_key(monkeypatch):
    # each was a ~200-line traceback from the instance's constructor (a user-journey review)
    import importlib.util

    from workers.generation import support
    from workers.generation.config import EngineConfig

    monkeypatch.setattr(support, "cuda_devices", lambda: 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the interpreter would run it, slowly)
    problem = support.engine_problem(EngineConfig(attention_backend="triton"), "rank 1 (generation)")
    assert problem.startswith("engine.attention_backend: 'triton' cannot run on rank 1 (generation), whose engine "
                              "device is cpu: it needs triton"), problem
    problem = support.engine_problem(EngineConfig(device="cuda", attention_backend="cpu"), "rank 1 (generation)")
    assert problem.startswith("engine.device: 'cuda', but CUDA is not available"), problem
    monkeypatch.setattr(support, "cuda_devices", lambda: 1)
    problem = support.engine_problem(EngineConfig(device="cuda", attention_backend="cpu"), "rank 1 (generation)")
    assert problem == ("engine.attention_backend: 'cpu' is the CPU kernel, but the engine on rank 1 (generation) "
                       "runs on cuda; use 'auto'")
    monkeypatch.setattr(support, "cuda_devices", lambda: 0)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    problem = support.engine_problem(EngineConfig(backend="vllm"), "rank 3 (generation)")
    assert problem.startswith("engine.backend: 'vllm', but on rank 3 (generation): vLLM is not installed: "), problem
    for ok in (EngineConfig(), EngineConfig(attention_backend="cpu"), EngineConfig(attention_backend="torch")):
        assert support.engine_problem(ok, "rank 1 (generation)") is None
    with pytest.raises(ValueError, match=r"^engine.backend_options: is read by the vllm backend "
                                         r"\(vLLM.s own EngineArgs\) and by your own engine"):
        EngineConfig(backend_options={"gpu_memory_utilization": 0.9})
    assert EngineConfig(backend="vllm", backend_options={"gpu_memory_utilization": 0.9}).backend_options


def test_ranker_options_and_saved_kind_checked_at_load(tmp_path):
    """ranker.options are built at load (not at the bootstrap, after the engines started), and
    a folder at ranker.path holding another kind of ranker than ranker.kind is refused."""
    with pytest.raises(ConfigError, match=r"ranker.options: .*rounds"):
        from_dict({"ranker": {"kind": "lgbm", "path": str(tmp_path / "new"), "options": {"rounds": "x"}}})
    with pytest.raises(ConfigError, match=r"ranker.options: .*nope"):
        from_dict({"ranker": {"kind": "lgbm", "path": str(tmp_path / "new"), "options": {"nope": 1}}})
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "meta.json").write_text('{"kind": "lgbm"}')
    with pytest.raises(ConfigError, match=rf"ranker.kind: 'ensemble', but {saved} holds a 'lgbm' ranker"):
        from_dict({"ranker": {"kind": "ensemble", "path": str(saved)}})
    assert from_dict({"ranker": {"kind": "lgbm", "path": str(saved)}}).ranker.kind == "lgbm"


@pytest.mark.parametrize("value, want", [("false", False), ("true", True), ("auto", "auto"), ("off", False)])
def test_engine_cpu_prepack_takes_auto_or_a_yaml_boolean(value, want):
    """A key typed ``str | bool`` takes either (the schema tries each type of a union); YAML 1.1
    reads off/no as false, which means what the user wrote."""
    assert load_config("configs/quickstart.yaml", overrides=[f"engine.cpu_prepack={value}"]).engine.cpu_prepack == want


@pytest.mark.parametrize("value, message", [
    ("0", "engine.cpu_prepack: expected str or bool, got int 0"),
    ("fast", "engine.cpu_prepack: must be 'auto', true or false, got 'fast'")])
def test_engine_cpu_prepack_bad_values_name_the_key(value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/quickstart.yaml", overrides=[f"engine.cpu_prepack={value}"])


def test_skew_dispatch_needs_a_ranker():
    """With ranker.kind none every estimate is max_tokens: skew_paper ran ~2x round_robin's makespan."""
    for name in ("skew", "skew_paper"):
        with pytest.raises(ConfigError, match=f"dispatch.name: {name} dispatches on output-length estimates"):
            from_dict(_cfg(dispatch={"name": name}), 3)
