"""The vLLM backend inside the runtime (vLLM tier): controller + a vLLM generation instance +
a trainer rank under torchrun, in StreamRL-Async, where each weight push overlaps generation.
vLLM's in-place reload takes ~1 s on CPU, long enough for the next version to arrive while
the previous one loads (a race that once dropped it). Skipped where vLLM is not installed."""
import subprocess

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install_vllm.sh): vLLM tests skipped")

from runtime_helpers import TASK, iterations, last_json, torchrun, write_config  # noqa: E402

pytestmark = pytest.mark.vllm


def _engine_cores() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "VLLM::EngineCore"], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A tiny model whose head size vLLM's CPU attention supports (32)."""
    from workers.model import ModelConfig
    from workers.tasks.registry import make_task
    from workers.trainer.bootstrap import build_model_dir

    d = tmp_path_factory.mktemp("vllm_rt") / "model"
    cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    build_model_dir(d, make_task("synthetic", **TASK), cfg, sft_steps=0)
    return str(d)


@pytest.mark.timeout(900)
def test_async_stream_with_vllm_instances(tmp_path, vllm_model):
    before = _engine_cores()
    cfg = write_config(tmp_path, vllm_model, engine__backend="vllm", engine__block_size=32,
                       train__iterations=5, train__eval_every=0)
    p = torchrun(cfg, timeout=800)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "VLLMEngine(vllm" in p.stderr and "enforce_eager True" in p.stderr  # what runs on a CPU
    rows = iterations(tmp_path / "run")
    assert [r["num_samples"] for r in rows] == [8] * 5
    assert [r["gen_version"] for r in rows] == [0, 0, 1, 2, 3]  # one-step off-policy, every push loaded
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert last_json(p.stdout)["iterations"] == 5
    assert _engine_cores() <= before  # the engine core process left with its instance


@pytest.mark.timeout(900)
def test_a_stopped_job_leaves_no_vllm_engine_core_behind(tmp_path, vllm_model):
    # SIGTERM to torchrun (Slurm, Kubernetes): the generation rank leaves by os._exit, which
    # skips vLLM's own shutdown; its engine core (a spawned child) must not run on, holding its
    # (GPU) memory. Outside torchrun it did (controller/lifecycle.end_children); here torchrun's
    # group kill and the core's own die_with_launcher end it too, and this keeps it so.
    import os
    import signal
    import sys
    import time

    from runtime_helpers import ROOT, free_port

    before = _engine_cores()
    cfg = write_config(tmp_path, vllm_model, engine__backend="vllm", engine__block_size=32,
                       train__iterations=10_000, train__eval_every=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
           str(free_port()), str(ROOT / "controller/main.py"), "--config", str(cfg)]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        rows = tmp_path / "run" / "iterations.jsonl"
        while not (rows.exists() and rows.read_text()):  # generating and training (the suite's timeout ends a hang)
            assert p.poll() is None, "the run ended before its first iteration"
            time.sleep(0.5)
        ours = _engine_cores() - before
        assert ours, "no vLLM engine core process was found while the run generated"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert "[controller] stopped by SIGTERM" in err, err[-3000:]
    deadline = time.monotonic() + 30
    while ours & _engine_cores() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ours & _engine_cores(), "the vLLM engine core outlived its generation rank"


@pytest.mark.timeout(900)
def test_lora_merged_weights_reach_vllm(tmp_path, vllm_model):
    """trainer.lora_rank: the engine gets the merged weights (W + scale B A) under the base's names
    and shapes, as a full-parameter trainer's; vLLM loads each version."""
    cfg = write_config(tmp_path, vllm_model, engine__backend="vllm", engine__block_size=32, trainer__lora_rank=4,
                       train__iterations=3, train__eval_every=0, pipeline__mode="stream")
    p = torchrun(cfg, timeout=800)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = iterations(tmp_path / "run")
    assert [(r["version"], r["gen_version"]) for r in rows] == [(1, 0), (2, 1), (3, 2)]
    assert (tmp_path / "run" / "checkpoints" / "iter_000003" / "trainer" / "adapter" / "adapter_config.json").is_file()
