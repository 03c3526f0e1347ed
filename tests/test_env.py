"""workers.env.env_var, and the spawned children that read what it sets (the planner's
shared-host A/B background): set for the block, put back as it was, also when the block raises."""
import os

import pytest

from controller.planner.host import concurrent_slowdown, serve
from workers.env import env_var


def test_env_var_is_set_for_the_block_and_put_back(monkeypatch):
    monkeypatch.setenv("STREAMRL_T", "a")
    monkeypatch.delenv("STREAMRL_U", raising=False)
    with env_var("STREAMRL_T", "b"), env_var("STREAMRL_U", "c"):
        assert (os.environ["STREAMRL_T"], os.environ["STREAMRL_U"]) == ("b", "c")
    assert os.environ["STREAMRL_T"] == "a" and "STREAMRL_U" not in os.environ
    with pytest.raises(KeyError), env_var("STREAMRL_U", "d"):
        raise KeyError("x")
    assert "STREAMRL_U" not in os.environ


def _threads_env_load(out, gate) -> None:
    out.put(os.environ.get("OMP_NUM_THREADS"))
    serve(gate, lambda: sum(range(1000)))


def test_the_slowdown_background_starts_on_one_thread_and_the_env_is_restored(monkeypatch):
    import multiprocessing as mp

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    out = mp.get_context("spawn").Queue()
    got = concurrent_slowdown(lambda: 0.01, _threads_env_load, (out,), rounds=2)
    assert out.get(timeout=60) == "1" and os.environ["OMP_NUM_THREADS"] == "7"
    assert got["slowdown"] >= 1.0
