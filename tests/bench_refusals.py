"""Runs bench scripts' command lines, each as ``__main__`` in a process of its own, forked from
this one after the imports they share (torch, the project's packages): each child is what
``python bench/<script>.py ARGV`` is once its imports are done (its own stdout, stderr and exit
code; an uncaught exception printed with its traceback, exit code 1), without paying for the
imports once per script. For tests/test_bench_cli.py (a bad argument refused before any work).

    python tests/bench_refusals.py  < JSON [[script, [argv...]], ...]
    -> JSON {script: [returncode, stdout, stderr]}"""
import json
import os
import runpy
import sys
import tempfile
import threading
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import torch  # noqa: E402,F401  (what every bench imports; then the project's packages)
import controller.session  # noqa: E402,F401
import workers.generation.engine  # noqa: E402,F401
import workers.trainer  # noqa: E402,F401
import workers.weight_sync  # noqa: E402,F401
import workers.tasks.reward_pool  # noqa: E402,F401


def _child(script: str, argv: list[str], out: str, err: str) -> None:
    """In the forked process: stdout/stderr to the files, the script as ``__main__``; never returns."""
    code = 1
    try:
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        path = str(BENCH / f"{script}.py")
        sys.argv = [path, *argv]
        sys.path[0] = str(BENCH)  # as `python bench/<script>.py` sets it
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as e:  # what the interpreter does with it
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - the interpreter's report of an uncaught exception
            traceback.print_exc()
            code = 1
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def main() -> None:
    runs = json.load(sys.stdin)
    assert threading.active_count() == 1, "fork from a single-threaded process only"
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_refusals_") as d:
        pids = {}
        for script, argv in runs:
            out, err = os.path.join(d, f"{script}.out"), os.path.join(d, f"{script}.err")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(script, argv, out, err)
            pids[pid] = (script, out, err)
        for pid, (script, out, err) in pids.items():
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            results[script] = [code, Path(out).read_text(), Path(err).read_text()]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
