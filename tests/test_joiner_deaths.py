"""Joiners that die or are stopped mid-round, with real processes (a 3-rank torchrun job with the
REPL on its stdin, processes joining it with ``--join``): flows review, s59.

* A joiner SIGKILLed stays a member of torch's dynamic RPC group (nothing can drop it): the next
  ``--join`` called it, hung for its whole ``--rpc-timeout`` holding the group's join token, then
  died with two raw tracebacks, and no process could join or leave the graceful way after it.
  Now the controller notes the death in torchrun's store and a later joiner refuses in one line.
* A joiner SIGTERMed mid-round left the RPC group before its round's report went out whenever an
  engine step took 0.1 s or more: the controller found it lost and generated all its requests
  again. Now it waits for the calls it serves first. (The slow engine is the project's own
  engine slowed down, through the ``engine.backend: file.py:Name`` plugin option.)
"""
import json
import signal
import time

import pytest

from runtime_helpers import iterations, tiny_model, write_config  # noqa: F401  (tiny_model: fixture)
from test_repl_leave import _job_and_joiner, _last_commands, _registered

SLOW_ENGINE = '''
import dataclasses, pathlib, time
from controller.process_state import LOCAL
from workers.generation.engine import NativeEngine


class Slow(NativeEngine):
    """The native engine with {delay_s} s more per step; a joiner's first step writes the marker."""

    def __init__(self, cfg, model_dir):
        super().__init__(dataclasses.replace(cfg, backend="native", backend_options={{}}), model_dir)

    def step(self):
        if LOCAL.rank >= 3:
            pathlib.Path({marker!r}).touch()
        time.sleep({delay_s})
        return super().step()
'''


@pytest.mark.slow  # ~40 s on 2 cores (a job, two joiners): the CI's slow tier runs it
def test_a_joiner_after_one_died_in_the_group_is_refused_in_one_line(tmp_path, tiny_model):  # noqa: F811
    cfg = write_config(tmp_path, tiny_model, train__iterations=8, train__eval_every=0)
    with _job_and_joiner(cfg) as (main, joiner):
        _registered(joiner, 3)
        joiner.send_signal(signal.SIGKILL)
        joiner.wait(timeout=60)
        for line in main.stderr:  # the keepalive finds it gone, then it is noted dead
            if "rank 3 died without leaving the RPC group" in line:
                break
        late = main.join()
        late_err = late.communicate(timeout=120)[1]  # it hung for its --rpc-timeout (300 s)
        out, err = _last_commands(main, "run 2\nstatus\nquit\n")
    assert late.returncode == 1 and "Traceback" not in late_err, late_err[-3000:]
    assert late_err.splitlines()[-1].startswith("[join] the job at 127.0.0.1:"), late_err[-3000:]
    assert "takes no more joiners: rank 3, a process that joined it, died without leaving its RPC group" in late_err
    assert main.returncode == 0, err[-4000:]
    run2, status = [json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith(">>> ")][-2:]
    assert run2["ran"] == 2 and status["instances"] == 1 and status["waiting"] == []
    assert [r["num_samples"] for r in iterations(tmp_path / "run")] == [8, 8]


@pytest.mark.slow  # ~50 s on 2 cores (a job with slowed engines, a joiner): the CI's slow tier runs it
def test_a_joiner_sigtermed_mid_round_reports_its_round_before_it_leaves(tmp_path, tiny_model):  # noqa: F811
    marker = tmp_path / "joiner_stepping"
    plugin = tmp_path / "slow_engine.py"
    plugin.write_text(SLOW_ENGINE.format(delay_s=0.5, marker=str(marker)))
    cfg = write_config(tmp_path, tiny_model, train__iterations=8, train__eval_every=0,
                       placement__force_scale_out_at=1, engine__backend=f"{plugin}:Slow")
    with _job_and_joiner(cfg) as (main, joiner):
        _registered(joiner, 3)
        main.stdin.write("run 3\n")
        main.stdin.flush()
        deadline = time.monotonic() + 240
        while not marker.exists() and time.monotonic() < deadline:  # the joiner is in its first round
            time.sleep(0.05)
        assert marker.exists()
        joiner.send_signal(signal.SIGTERM)
        joiner_err = joiner.communicate(timeout=120)[1]
        out, err = _last_commands(main, "status\nquit\n")
    assert joiner.returncode == 130 and "rank 3 stopped by SIGTERM: it leaves the job" in joiner_err, joiner_err[-3000:]
    assert main.returncode == 0, err[-4000:]
    assert "[sgs] instance rank 3 removed: stopped" in err, err[-4000:]
    assert "rank 3 removed: worker rank 3 (generation) was lost" not in err and "died without leaving" not in err
    run3, status = [json.loads(ln[4:]) for ln in out.splitlines() if ln.startswith(">>> ")][-2:]
    assert run3["ran"] == 3 and status["instances"] == 1
    assert [r["num_samples"] for r in iterations(tmp_path / "run")] == [8, 8, 8]
