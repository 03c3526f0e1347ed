"""``ranker.kind: module:Name`` / ``file.py:Name``: your own output-length ranker (ranker/store.py).
Built with ``ranker.options``, saved and loaded by the name it was built by, checked at config
load; a real 3-process run bootstraps it from the policy's lengths, saves it at ``ranker.path``
and updates it online. The ranker here is a user's least-squares fit on two prompt features
(a real model, numpy)."""
import json

import numpy as np
import pytest

import ranker
from runtime_helpers import tiny_model, torchrun, write_config  # noqa: F401

MY_RANKER = '''
import json
import numpy as np
from ranker.base import LogLengthRanker


class PromptLength(LogLengthRanker):
    """log(1 + words) ~ a + b * log(1 + prompt characters) + c * (digits in the prompt), least squares."""

    def __init__(self, ridge=0.0, calls=None):
        self.ridge, self.calls, self.w = float(ridge), calls, None

    def _say(self, what, n):
        if self.calls:
            with open(self.calls, "a") as f:
                f.write(json.dumps({"call": what, "rows": n}) + "\\n")

    @property
    def fitted(self):
        return self.w is not None

    @property
    def min_rows(self):
        return 3

    def _x(self, prompts):
        return np.array([[1.0, np.log1p(len(p)), sum(c.isdigit() for c in p)] for p in prompts])

    def fit(self, prompts, lengths):
        self._need_rows(len(prompts), "fit")
        x, y = self._x(prompts), np.log1p(np.asarray(lengths, dtype=float))
        self.w = np.linalg.solve(x.T @ x + self.ridge * np.eye(3), x.T @ y)
        self._say("fit", len(prompts))
        return self

    def update(self, prompts, lengths):
        self._say("update", len(prompts))
        return self.fit(prompts, lengths)

    def predict_log(self, prompts):
        self._need_fitted()
        return self._x(prompts) @ self.w

    def meta(self):
        return {"config": {"ridge": self.ridge}}

    def save_files(self, folder):
        np.save(folder / "w.npy", self.w)

    @classmethod
    def load_files(cls, folder, meta):
        r = cls(**meta["config"])
        r.w = np.load(folder / "w.npy")
        return r


class Forgetful(LogLengthRanker):
    """Inherits the base's fitted and min_rows, which only raise: not a ranker yet."""

    def fit(self, prompts, lengths): ...
    def update(self, prompts, lengths): ...
    def predict_log(self, prompts): ...
    def save_files(self, folder): ...
    @classmethod
    def load_files(cls, folder, meta): ...
    def meta(self): return {}


class NotARanker:
    pass


class NeedsAGpu(PromptLength):
    def __init__(self, **kw):
        raise RuntimeError("no GPU here")


class Chunked(PromptLength):
    """Options named as ranker.bootstrap's own arguments (n, chunk) reach the class."""

    def __init__(self, n=1, chunk=1, **kw):
        super().__init__(**kw)
        self.n, self.chunk = n, chunk
'''


@pytest.fixture()
def plugin(tmp_path):
    (tmp_path / "my_ranker.py").write_text(MY_RANKER)
    return f"{tmp_path / 'my_ranker.py'}:PromptLength"


def test_your_own_ranker_fits_saves_and_loads_by_its_name(tmp_path, plugin):
    prompts = [f"Add {' + '.join(['7'] * k)}." for k in range(1, 9)]
    lengths = [4.0 * k for k in range(1, 9)]  # longer prompts, longer answers
    r = ranker.build(plugin, ridge=0.01).fit(prompts, lengths)
    assert r.kind == plugin
    est = r.predict(prompts)
    assert est == sorted(est) and all(e > 0 for e in est)
    r.save(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "meta.json").read_text())["kind"] == plugin
    back = ranker.load(tmp_path / "saved")
    assert type(back).__name__ == "PromptLength" and back.kind == plugin and back.ridge == 0.01
    assert np.allclose(back.predict(prompts), est)


def test_a_ranker_that_is_not_one_is_refused_naming_the_key(tmp_path, plugin):
    from controller.config import ConfigError, from_dict

    base = {"placement": {"generation": [1], "trainer": [2]}}

    def load(name, **kw):
        return from_dict({**base, "ranker": {"kind": plugin.replace(":PromptLength", f":{name}"),
                                             "path": str(tmp_path / "r"), **kw}}, world_size=3)

    with pytest.raises(ConfigError, match=r"ranker.kind: '.*:Forgetful' does not define fitted, min_rows: a ranker "
                                          r"of your own defines fit, update, predict_log, fitted, min_rows"):
        load("Forgetful")
    with pytest.raises(ConfigError, match=r"ranker.kind: '.*:NotARanker' is not a subclass of "
                                          r"ranker.base.LogLengthRanker"):
        load("NotARanker")
    with pytest.raises(ConfigError, match=r"ranker.kind: '.*:NeedsAGpu': building it with ranker.options \{\} "
                                          r"failed \(RuntimeError: no GPU here\)"):
        load("NeedsAGpu")
    assert load("Chunked", options={"n": 3, "chunk": 2}).ranker.options == {"n": 3, "chunk": 2}
    with pytest.raises(ConfigError, match=r"ranker.options: .*unexpected keyword argument 'depth'"):
        from_dict({**base, "ranker": {"kind": plugin, "path": str(tmp_path / "r"), "options": {"depth": 3}}},
                  world_size=3)
    with pytest.raises(ConfigError, match=r"ranker.kind: 'xgboost' is not one of \['none', 'ensemble', 'lgbm', "
                                          r"'lm'\], nor module:Name / file.py:Name of your own"):
        from_dict({**base, "ranker": {"kind": "xgboost", "path": str(tmp_path / "r")}}, world_size=3)
    from_dict({**base, "ranker": {"kind": plugin, "path": str(tmp_path / "r")}}, world_size=3)  # loads


def test_a_relative_spec_is_recorded_with_its_absolute_path(tmp_path, plugin, monkeypatch):
    from controller.config import from_dict

    monkeypatch.chdir(tmp_path)
    cfg = from_dict({"placement": {"generation": [1], "trainer": [2]},
                     "ranker": {"kind": "./my_ranker.py:PromptLength", "path": "r"}}, world_size=3)
    assert cfg.ranker.kind == plugin  # the same class, named the same from any folder
    r = ranker.build("my_ranker.py:PromptLength", ridge=0.01).fit(["a", "bb", "ccc 1"], [1.0, 2.0, 3.0])
    r.save(tmp_path / "r")
    monkeypatch.chdir(tmp_path.parent)
    assert ranker.load(tmp_path / "r").kind == plugin
    # options named as bootstrap's own arguments go to the class
    got = ranker.bootstrap(lambda batch: [float(len(p)) for p in batch], ["a", "bb", "ccc", "dddd"], n=4,
                           kind=plugin.replace(":PromptLength", ":Chunked"), chunk=2,
                           options={"n": 7, "chunk": 5, "ridge": 0.01})
    assert (got.n, got.chunk) == (7, 5) and got.fitted
    (tmp_path / "my_ranker.py").unlink()
    with pytest.raises(ValueError, match=r"r/meta.json: ranker kind '.*my_ranker.py:PromptLength' does not load: "
                                         r"ranker.kind: .*my_ranker.py .* is not a file"):
        ranker.load(tmp_path / "r")


def test_a_run_bootstraps_your_ranker_saves_it_and_updates_it(tmp_path, tiny_model, plugin):  # noqa: F811
    calls = tmp_path / "calls.jsonl"
    p = torchrun(write_config(tmp_path, tiny_model, ranker__kind=plugin, ranker__path=str(tmp_path / "ranker"),
                              ranker__bootstrap_prompts=8, ranker__update_every=2,
                              ranker__options={"calls": str(calls)}, dispatch__name="skew"), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"no {plugin} ranker at {tmp_path / 'ranker'}; bootstrapped one" in p.stderr
    said = [json.loads(ln) for ln in calls.read_text().splitlines()]
    assert said[0] == {"call": "fit", "rows": 8}  # the bootstrap, on 8 prompts
    assert [c["call"] for c in said[1:]].count("update") >= 1  # update_every 2, 3 iterations
    saved = ranker.load(tmp_path / "ranker")
    assert saved.kind == plugin and saved.fitted
