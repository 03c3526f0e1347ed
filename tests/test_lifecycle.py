"""How a run starts and stops around its processes: the run folder's lock, a full disk found
at start, the resume hint of every stop, a damaged or missing checkpoint named with the one to
take instead, ranks that would sit idle, and a rank that dies with its launcher (a real
process tree: the launcher is SIGKILLed)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from controller import checkpoint as ckpt
from controller import lifecycle, preflight
from controller.config import ConfigError, from_dict, load_config
from runtime_helpers import ROOT


def test_a_second_job_in_a_running_jobs_folder_is_refused(tmp_path):
    held = preflight.lock_run_folder(tmp_path)
    with pytest.raises(ConfigError, match=rf"logging.logdir: {tmp_path} is in use by a running job "
                                          rf"\(pid {os.getpid()} on "):
        preflight.lock_run_folder(tmp_path)  # a second descriptor: what another process would get
    os.close(held)  # the first job ended (its process exit releases the lock the same way)
    os.close(preflight.lock_run_folder(tmp_path))


def test_a_disk_with_no_room_is_found_at_start(tmp_path):
    # a file-size limit stands in for a full disk (mounting a full file system needs root):
    # either way the empty file the check used to write fitted, the first real write failed
    preflight.check_writable(tmp_path)  # room here
    code = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from pathlib import Path
        from controller.config import ConfigError
        from controller.preflight import check_writable
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            check_writable(Path({str(tmp_path)!r}))
        except ConfigError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(f"logging.logdir: {tmp_path}: cannot write there (File too large)"), out


def _checkpoint(root, it):
    d = root / "checkpoints" / f"iter_{it:06d}"
    d.mkdir(parents=True)
    (d / "controller.json").write_text("{}")
    return d


def test_latest_naming_a_missing_checkpoint_says_which_it_takes(tmp_path, capsys):
    _checkpoint(tmp_path, 3)
    six = _checkpoint(tmp_path, 6)
    (tmp_path / "checkpoints" / "latest").write_text("iter_000099")
    assert ckpt.find(tmp_path) == six
    assert "latest names iter_000099, which is missing; taking the newest complete checkpoint, iter_000006" \
        in capsys.readouterr().err
    assert ckpt.previous(six) == tmp_path / "checkpoints" / "iter_000003" and ckpt.previous(tmp_path / "x") is None
    assert ckpt.resume_hint(tmp_path) == f"the last checkpoint is {six}: continue with --resume {six}"
    assert ckpt.resume_hint(tmp_path / "empty") == "no checkpoint was written yet (train.ckpt_every)"
    # a resume that forked into another folder names that folder's newest, not the one it came from
    forked = _checkpoint(tmp_path / "b", 8)
    assert ckpt.resume_hint(tmp_path / "b", str(six)) == f"the last checkpoint is {forked}: continue with --resume {forked}"
    assert ckpt.resume_hint(tmp_path / "c", str(six)).startswith(f"the last checkpoint is {six}")  # nothing new yet


def test_ranks_no_role_would_use_are_refused():
    d = {"placement": {"generation": [1], "trainer": [2]}}
    assert from_dict(d, 3).world_ranks == 3
    with pytest.raises(ConfigError, match=r"world size 5: ranks \[3, 4\] are in neither placement.generation \[1\] "
                                          r"nor placement.trainer \[2\] and would sit idle"):
        from_dict(d, 5)
    # a hole in the placement: configs/cluster_h20_h800.yaml left ranks 17-23 of its 32 idle, and loaded
    with pytest.raises(ConfigError, match=r"^placement: ranks \[2, 3\] are in neither placement.generation \[1\] "
                                          r"nor placement.trainer \[4\], below its highest rank 4, and would sit idle"):
        from_dict({"placement": {"generation": [1], "trainer": [4]}})
    assert load_config(ROOT / "configs" / "cluster_h20_h800.yaml", 32).world_ranks == 32


def test_configs_that_differ_are_named_by_key():
    a = {"train": {"iterations": 3, "lr": 1.0}, "engine": {"block_size": 16}}
    b = {"train": {"iterations": 4, "lr": 1.0}, "engine": {"block_size": 16, "extra": 1}}
    assert lifecycle._differing_keys(a, b) == ["engine.extra", "train.iterations"]
    assert lifecycle._differing_keys(a, a) == []


def test_sigterm_is_taken_as_an_interrupt_naming_the_signal_and_a_second_one_waits():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    lifecycle.signals_interrupt(signal.SIGTERM, signal.SIGHUP)
    try:
        with pytest.raises(lifecycle.Terminated, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises in this (the main) thread first
        # Slurm signals every process and torchrun forwards it too: the second must not break
        # the way out the first took (it is ignored from then on)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.1)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_a_rank_dies_with_its_launcher(tmp_path):
    # launcher -> rank; SIGKILL the launcher (torchrun's agent OOM-killed, say): the rank must not
    # live on as an orphan
    rank = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from controller.lifecycle import die_with_launcher
        die_with_launcher()
        print("ready", flush=True)
        time.sleep(120)
    """)
    launcher = textwrap.dedent(f"""
        import subprocess, sys, json
        p = subprocess.Popen([sys.executable, "-c", {rank!r}], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        print(json.dumps(p.pid), flush=True)
        p.wait()
    """)
    outer = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    pid = json.loads(outer.stdout.readline())
    outer.kill()
    outer.wait()
    for _ in range(200):  # the kernel delivers the rank's SIGKILL as the launcher exits
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split()[2] == "Z":  # killed, waiting for init to reap it
                break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the rank outlived its launcher")


_AGREE_RANK = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from controller import lifecycle
    rank, said = int(os.environ["RANK"]), {said!r}

    def say(text):
        if rank == 0:
            time.sleep(2.0)  # a slow terminal on the other node
        with open(f"{{said}}/{{rank}}", "w") as f:
            f.write(text)

    cfg = {{"train": {{"iterations": 2}}}}
    err = lifecycle.agree_on_config(rank, 2, None if rank == 1 else cfg, "train.iterations: must be >= 1",
                                    20.0, say=say)
    print(sorted(os.listdir(said)), err, flush=True)
""")


def test_no_rank_leaves_a_config_error_before_every_rank_has_said_it(tmp_path):
    # the store lives in one node's torchrun agent, which ends when its ranks exit; the other
    # node's agent then kills its ranks. CI once lost node 0's "config error" line that way: the
    # rank with the error left as soon as it had published it, before rank 0 had printed.
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    said = tmp_path / "said"
    said.mkdir()
    code = _AGREE_RANK.format(root=str(os.getcwd()), said=str(said))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r)), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    del store
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    for out, _ in outs:  # each rank, as it returned, saw both ranks' lines already said
        assert out.strip() == "['0', '1'] train.iterations: must be >= 1" \
            or out.strip() == "['0', '1'] (rank 1) train.iterations: must be >= 1", out
    assert (said / "0").read_text() == "config error: (rank 1) train.iterations: must be >= 1"
    assert (said / "1").read_text() == "config error: train.iterations: must be >= 1"


_WITH_CHILDREN = textwrap.dedent("""
    import multiprocessing as mp, os, signal, subprocess, sys, time
    sys.path.insert(0, {root!r})
    from controller import lifecycle

    if __name__ == "__main__":
        polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # ends on SIGTERM
        stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                     "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                                     "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        stubborn.stdout.readline()
        lock = mp.get_context("spawn").Lock()  # starts multiprocessing's resource tracker
        print(polite.pid, stubborn.pid, sorted(lifecycle.child_pids()), flush=True)
        print(lifecycle.end_children(grace_s=2.0), flush=True)
        os._exit(130)
""")


def test_a_rank_leaving_by_os_exit_ends_its_child_processes(tmp_path):
    # os._exit skips the hooks that stop an engine's own process: vLLM's engine core outlived
    # a generation rank stopped by Ctrl-C (10 minutes later it still held 828 MB and the pipes)
    script = tmp_path / "rank.py"
    script.write_text(_WITH_CHILDREN.format(root=os.getcwd()))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 130, out.stderr[-2000:]
    first, killed = out.stdout.splitlines()
    polite, stubborn, *rest = first.split(" ", 2)
    children = json.loads(rest[0])
    assert int(polite) in children and int(stubborn) in children and len(children) == 3  # + the tracker
    # only the one that ignored SIGTERM needed SIGKILL; the resource tracker (it ignores SIGTERM
    # too) was left to end by itself
    assert json.loads(killed) == [int(stubborn)]
    for pid in (int(polite), int(stubborn)):
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
