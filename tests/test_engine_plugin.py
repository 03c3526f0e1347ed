"""``engine.backend: module:Name`` / ``file.py:Name``: your own engine (workers/generation/factory.py).
Its class is loaded and its methods checked when the config loads; ``make_engine`` builds it with
the EngineConfig and the model folder; a real 3-process run generates with it and pushes it the
trainer's weights. The engine here is a user's wrapper around the native one (a real engine)."""
import json

import pytest
import torch

from runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401
from workers.generation.config import EngineConfig
from workers.generation.generate_all import generate_all
from workers.generation.factory import check_backend, make_engine
from workers.model import save_pretrained
from workers.types import Request, SamplingParams

torch.set_num_threads(1)

MY_ENGINE = '''
import dataclasses, json
from workers.generation.engine import NativeEngine


class Recording:
    """A user's engine: the native one, recording what the runtime asks of it in a file."""

    def __init__(self, cfg, model_dir):
        self.log = cfg.backend_options["log"]  # its own setting, from engine.backend_options
        inner = dataclasses.replace(cfg, backend="native", backend_options={})
        self.inner = NativeEngine(inner, model_dir)
        self.max_model_len = self.inner.max_model_len
        self._say("built", model_dir=model_dir, max_batch_size=cfg.max_batch_size)

    def _say(self, what, **kw):
        with open(self.log, "a") as f:
            f.write(json.dumps({"call": what, **kw}) + "\\n")

    def add(self, requests):
        self._say("add", n=len(requests))
        return self.inner.add(requests)

    def step(self):
        return self.inner.step()

    def has_work(self):
        return self.inner.has_work()

    def abort(self, sample_ids):
        return self.inner.abort(sample_ids)

    def load_weights(self, named_tensors, version):
        self._say("load_weights", version=version)
        self.inner.load_weights(named_tensors, version)

    def set_max_batch_size(self, n):
        self.inner.set_max_batch_size(n)

    def stats(self):
        return self.inner.stats()

    def close(self):
        self._say("close")
        self.inner.close()


class NoAbort:
    def __init__(self, cfg, model_dir):
        pass

    def add(self, requests): ...
    def step(self): ...
    def has_work(self): ...
    def load_weights(self, named_tensors, version): ...
    def set_max_batch_size(self, n): ...
    def stats(self): ...
    def close(self): ...


def not_an_engine(cfg, model_dir):
    return object()


class Forwarding:
    """Methods reached through __getattr__ (a proxy): only the built object can be checked."""

    def __init__(self, cfg, model_dir):
        self._inner = Recording(cfg, model_dir)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class DictStats(Recording):
    def stats(self):
        return vars(self.inner.stats())
'''


@pytest.fixture()
def plugin(tmp_path):
    (tmp_path / "my_engine.py").write_text(MY_ENGINE)
    return tmp_path / "my_engine.py"


def _calls(log) -> list[dict]:
    return [json.loads(ln) for ln in log.read_text().splitlines()]


def test_your_own_engine_is_built_with_the_config_and_generates(tmp_path, plugin):
    from test_engine import MODEL

    folder = tmp_path / "model"
    save_pretrained(MODEL, folder)
    log = tmp_path / "calls.jsonl"
    common = dict(block_size=4, kv_cache_tokens=4096, max_batch_size=8, device="cpu", dtype="float32")
    mine = make_engine(EngineConfig(backend=f"{plugin}:Recording", backend_options={"log": str(log)}, **common),
                       str(folder))
    native = make_engine(EngineConfig(**common), str(folder))
    reqs = [Request(sample_id=i, prompt_ids=torch.arange(1, 4 + 3 * i), max_tokens=6,
                    sampling=SamplingParams(temperature=0.0)) for i in range(4)]
    got = {s.sample_id: s.output_ids.tolist() for s in generate_all(mine, reqs)}
    want = {s.sample_id: s.output_ids.tolist() for s in generate_all(native, reqs)}
    assert got == want and all(len(v) == 6 for v in got.values())
    mine.close()
    assert [c["call"] for c in _calls(log)] == ["built", "add", "close"]
    assert _calls(log)[0] == {"call": "built", "model_dir": str(folder), "max_batch_size": 8}


def test_a_forwarding_engine_is_checked_once_built(tmp_path, plugin):
    from test_engine import MODEL

    folder = tmp_path / "model"
    save_pretrained(MODEL, folder)
    cfg = dict(block_size=4, kv_cache_tokens=4096, device="cpu", dtype="float32",
               backend_options={"log": str(tmp_path / "calls.jsonl")})
    check_backend(f"{plugin}:Forwarding")  # no class-level methods: not refused at load
    eng = make_engine(EngineConfig(backend=f"{plugin}:Forwarding", **cfg), str(folder))
    out = generate_all(eng, [Request(sample_id=0, prompt_ids=torch.arange(1, 5), max_tokens=3,
                                     sampling=SamplingParams(temperature=0.0))])
    assert len(out[0].output_ids) == 3
    with pytest.raises(TypeError, match=r"engine.backend: '.*:DictStats': stats\(\) returned a dict, not a "
                                        r"workers.types.EngineStats"):
        make_engine(EngineConfig(backend=f"{plugin}:DictStats", **cfg), str(folder))


def test_a_generation_rank_that_cannot_load_your_engine_says_so(plugin):
    from workers.generation.support import engine_problem

    said = engine_problem(EngineConfig(backend="no_such_pkg:Engine"), "rank 1 (generation)")
    assert said.startswith("engine.backend: cannot import 'no_such_pkg'") and said.endswith("(on rank 1 (generation))")
    # the native engine's attention and device checks are not your engine's
    assert engine_problem(EngineConfig(backend=f"{plugin}:Recording", device="cpu", attention_backend="triton"),
                          "rank 1 (generation)") is None


def test_an_engine_that_is_not_one_is_refused_naming_the_key(plugin):
    with pytest.raises(ValueError, match=r"engine.backend: '.*my_engine.py:NoAbort' is a class without abort: an "
                                         r"engine needs the Engine Protocol's methods \(add, step, has_work, abort, "):
        check_backend(f"{plugin}:NoAbort")
    with pytest.raises(ValueError, match=r"engine.backend: '.*my_engine.py' has no attribute 'Nope'"):
        check_backend(f"{plugin}:Nope")
    with pytest.raises(ValueError, match=r"engine.backend: cannot import 'no_such_pkg' for 'no_such_pkg:Engine'"):
        check_backend("no_such_pkg:Engine")
    with pytest.raises(TypeError, match=r"engine.backend: '.*:not_an_engine' built a object, which has no add, step, "
                                        r"has_work, abort, load_weights, set_max_batch_size, stats, close, "
                                        r"max_model_len \(the Engine Protocol"):
        make_engine(EngineConfig(backend=f"{plugin}:not_an_engine"), "unused")
    with pytest.raises(ValueError, match=r"engine.backend: must be one of \('native', 'vllm'\), or module:Name / "
                                         r"file.py:Name of your own engine, got 'sglang'"):
        EngineConfig(backend="sglang")


def test_a_run_generates_with_your_engine_and_pushes_it_the_weights(tmp_path, tiny_model, plugin):  # noqa: F811
    log = tmp_path / "calls.jsonl"
    p = torchrun(write_config(tmp_path, tiny_model, engine__backend=f"{plugin}:Recording",
                              engine__backend_options={"log": str(log)}, train__iterations=4), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [it["iteration"] for it in iterations(tmp_path / "run")] == [0, 1, 2, 3]
    calls = _calls(log)
    assert calls[0]["call"] == "built" and calls[-1]["call"] == "close"
    assert sum(c["call"] == "add" for c in calls) >= 4  # every iteration's prompts (and the evals')
    # async_stream (one step off-policy): iterations 2 and 3 generate with the weights of steps 1
    # and 2; the last eval (eval_every 2, and at the end) with the final ones, of step 4
    assert [c["version"] for c in calls if c["call"] == "load_weights"] == [1, 2, 4]


def test_a_config_whose_engine_is_not_one_is_refused_at_load(tmp_path, plugin):
    from controller.config import ConfigError, from_dict

    d = {"placement": {"generation": [1], "trainer": [2]}, "engine": {"backend": f"{plugin}:NoAbort"}}
    with pytest.raises(ConfigError, match=r"engine.backend: '.*my_engine.py:NoAbort' is a class without abort"):
        from_dict(d, world_size=3)
