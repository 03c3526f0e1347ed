"""Ctrl-C on a running job (SIGINT to the whole process group, as a terminal sends it), or
SIGTERM to torchrun (how Slurm and Kubernetes stop a job; torchrun passes it to its ranks): one
line from the controller naming the last checkpoint, no traceback from the ranks, no process
left behind, and the checkpoint it names is whole and resumable."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from controller import checkpoint as ckpt
from tests.runtime_helpers import ROOT, free_port, tiny_model, write_config  # noqa: F401


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path, tiny_model, how):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, train__iterations=10_000, train__ckpt_every=2, train__eval_every=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port",
           str(free_port()), str(ROOT / "controller/main.py"), "--config", str(cfg)]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while ckpt.find(tmp_path / "run") is None or ckpt.find(tmp_path / "run").name < "iter_000004":
            assert p.poll() is None and time.time() < deadline, "the run ended or made no checkpoint"
            time.sleep(0.5)
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGTERM)  # torchrun only: it forwards the signal to its ranks
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    # SIGTERM: torchrun signals its ranks one after the other, and the controller sometimes sees a
    # worker gone before its own signal (a race not yet understood, see the session 15 note): it
    # then says the run stopped, and names the last checkpoint in its own line. Either way: one
    # line naming it, no Python traceback from a rank.
    said = ("[controller] interrupted",) if how == "ctrl-c" else ("[controller] stopped by SIGTERM",
                                                                  "[controller] the last checkpoint is")
    lines = [ln for ln in err.splitlines() if ln.startswith(said)]
    assert len(lines) == 1 and "the last checkpoint is" in lines[0], err[-3000:]
    assert "KeyboardInterrupt" not in err and "Terminated" not in err, err[-3000:]
    assert subprocess.run(["pgrep", "-f", str(cfg)], capture_output=True).returncode == 1  # nothing left
    found = ckpt.find(tmp_path / "run")
    assert str(found) in lines[0]
    state = json.loads((found / "controller.json").read_text())
    assert state["iteration"] >= 4 and (found / "trainer" / "model" / "model.safetensors").exists()
