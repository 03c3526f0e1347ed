"""Which GPU a rank's engine, vLLM child and Triton launches use, shown on the CPU with a patched
``torch.cuda`` (8 GPUs, ``LOCAL_RANK`` 3, a current device per thread as CUDA keeps it): a fake
only because this machine has no GPU (``tests/test_cuda.py`` runs the real thing on one).

torch RPC runs a worker's calls (the engine's constructor included) on threads of its own, and
a new thread's current GPU is 0: ``pick_device`` sets only the main thread's. An unset
``engine.device`` ("" or "cuda") put every engine of a node on GPU 0 (the native engine's
``torch.device("cuda")``, vLLM's ``current_device()``), and Triton launched on the thread's GPU,
not its tensors'."""
import threading
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels._launch import KernelCall
from workers.generation.config import EngineConfig
from workers.generation.vllm_process import gpu_index
from workers.model import resolve_device


@pytest.fixture
def eight_gpus(monkeypatch):
    """8 GPUs, this process LOCAL_RANK 3, its main thread's current GPU 3; other threads start on 0."""
    current = threading.local()
    main = threading.main_thread()

    def current_device():
        return getattr(current, "index", 3 if threading.current_thread() is main else 0)

    monkeypatch.setenv("LOCAL_RANK", "3")
    with mock.patch("torch.cuda.is_available", lambda: True), \
            mock.patch("torch.cuda.device_count", lambda: 8), \
            mock.patch("torch.cuda.current_device", current_device):
        yield


def on_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(v=fn()))
    t.start()
    t.join()
    return out["v"]


@pytest.mark.parametrize("spec", ["", None, "cuda"])
def test_an_unset_or_unindexed_device_is_the_ranks_gpu_on_any_thread(eight_gpus, spec):
    assert on_thread(lambda: resolve_device(spec)) == torch.device("cuda", 3)
    assert resolve_device(spec) == torch.device("cuda", 3)


def test_a_named_device_is_kept(eight_gpus):
    assert on_thread(lambda: resolve_device("cuda:1")) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_outside_a_launcher_the_current_gpu_is_kept(monkeypatch):
    """No ``LOCAL_RANK`` (a script that called ``torch.cuda.set_device(1)``): "cuda" is its GPU 1,
    as torch reads it, not GPU 0 (diff review, s55)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with mock.patch("torch.cuda.is_available", lambda: True), mock.patch("torch.cuda.device_count", lambda: 8), \
            mock.patch("torch.cuda.current_device", lambda: 1):
        assert resolve_device("cuda") == resolve_device("") == torch.device("cuda", 1)


def test_no_gpu_resolves_to_the_cpu(monkeypatch):
    with mock.patch("torch.cuda.is_available", lambda: False):
        assert resolve_device("") == torch.device("cpu")
        assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("spec, want", [("", 3), ("cuda", 3), ("cuda:5", 5), ("cpu", None)])
def test_vllm_child_gpu_is_the_ranks_from_an_rpc_thread(eight_gpus, spec, want):
    assert on_thread(lambda: gpu_index(EngineConfig(device=spec))) == want


def test_a_kernel_launch_makes_its_tensors_gpu_current():
    """Triton takes the launch device and stream from the thread's current GPU."""
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(("launch", grid))

    class Device:  # records torch.cuda.device(...) entered around the launch
        def __init__(self, d):
            self.d = d

        def __enter__(self):
            seen.append(("device", torch.device(self.d)))

        def __exit__(self, *exc):
            seen.append(("exit", None))

    with FakeTensorMode():
        q = torch.empty(2, 4, device="cuda:2")
    with mock.patch("torch.cuda.device", Device):
        KernelCall(Kernel(), (2,), (7, q), {})()
        KernelCall(Kernel(), (1,), (torch.zeros(2),), {})()  # the interpreter's CPU tensors: as they are
    assert seen == [("device", torch.device("cuda", 2)), ("launch", (2,)), ("exit", None), ("launch", (1,))]
