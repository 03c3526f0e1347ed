"""workers.generation.kernels_package: this project's ``kernels``, told apart from Hugging
Face's package of the same name (hub kernels, which transformers >= 5.25 requires).

The other package is stood in for by a bare module in ``sys.modules``: installing Hugging
Face's ``kernels`` into the test venv is the collision itself (transformers then imports names
from it, finds this project's package and the HF equivalence tests fail), so the real one
cannot be used here."""
import contextlib
import sys
import types

import pytest
import torch

from kernels import _launch
from workers.generation import kernels_package
from workers.generation.attention import PagedAttention
from workers.generation.config import EngineConfig
from workers.generation.engine import resolve_attention_backend
from workers.generation.kv_cache import KVCache

FOUND = "/venv/lib/python3.11/site-packages/kernels/__init__.py"


@pytest.fixture
def hub_kernels(monkeypatch):
    """Hugging Face's ``kernels`` first on the path: ``import kernels`` returns it."""
    mod = types.ModuleType("kernels")
    mod.__file__ = FOUND
    mod.CUDAProperties = type("CUDAProperties", (), {})  # one of the names transformers imports
    monkeypatch.setitem(sys.modules, "kernels", mod)
    return mod


def test_this_projects_kernels_load():
    k = kernels_package.load()
    assert k.PROJECT == "streamrl" and callable(k.triton_usable) and k.__file__.endswith("kernels/__init__.py")


def test_another_kernels_package_is_named_in_a_clear_error(hub_kernels):
    with pytest.raises(ImportError, match=rf"found {FOUND}, not StreamRL's kernels package.*transformers >= 5\.25"):
        kernels_package.load()


def test_the_engine_needs_it_only_on_cuda(hub_kernels):
    cfg = EngineConfig(block_size=16)
    with pytest.raises(ImportError, match="not StreamRL's kernels package"):
        resolve_attention_backend(cfg, torch.device("cuda"))  # "auto" asks whether triton runs there
    assert resolve_attention_backend(cfg, torch.device("cpu")) == "torch"


def test_the_triton_attention_backend_refuses_with_the_reason(hub_kernels):
    cache = KVCache(1, 4, 16, 1, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=rf"needs kernels.paged_decode: 'import kernels' found {FOUND}"):
        PagedAttention(cache, 2, 8, decode_kernel="triton")


def test_compile_check_without_triton_says_how_to_install_it(monkeypatch, capsys):
    """Used to end in a raw ``ModuleNotFoundError: triton`` traceback (the default venv has no
    triton). Where triton is installed, its absence is what the patch stands in for."""
    import json

    from kernels import compile_check
    monkeypatch.setattr(compile_check, "triton_available", lambda: False)
    assert compile_check.main(["80"]) == 1
    assert "setup.sh test,kernels" in json.loads(capsys.readouterr().out)["skipped"]


def test_kernel_arguments_are_checked_before_triton_is_needed():
    """Refused with a ValueError naming the argument (were a TypeError from inside torch, a
    ZeroDivisionError, and integer tensors normalised into truncated nonsense)."""
    from kernels.norm_rope import rms_norm, rotary
    from kernels.paged_decode import check_inputs, choose_launch

    q, cache = torch.zeros(2, 4, 64), torch.zeros(8, 16, 2, 64)
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"num_splits=2.5 must be an int >= 1"):
        choose_launch(q, cache, tables, 2.5)
    with pytest.raises(ValueError, match=r"num_splits=True must be an int >= 1"):
        choose_launch(q, cache, tables, True)
    empty = torch.zeros(8, 16, 0, 64)
    with pytest.raises(ValueError, match="at least one head"):
        check_inputs(q, empty, empty, tables, lens)
    ints = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="rms_norm: x has dtype torch.int64"):
        rms_norm(ints, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="rms_norm: weight has dtype torch.int32"):
        rms_norm(ints.float(), torch.ones(4, dtype=torch.int32), 1e-6)
    with pytest.raises(ValueError, match="rotary: x has dtype torch.int64"):
        rotary(torch.ones(1, 1, 4, dtype=torch.int64), torch.ones(1, 4), torch.ones(1, 4))


def test_inputs_on_several_devices_are_named():
    """(The meta device stands in for a CPU weight beside a CUDA x: the check runs before any
    kernel, on any machine.)"""
    from kernels.norm_rope import rms_norm, rotary

    x, meta = torch.zeros(3, 8), torch.zeros(8, device="meta")
    with pytest.raises(ValueError, match="rms_norm: inputs on several devices: x on cpu, weight on meta"):
        rms_norm(x, meta, 1e-6)
    with pytest.raises(ValueError, match="residual on meta"):
        rms_norm(x, torch.ones(8), 1e-6, residual=torch.zeros(3, 8, device="meta"))
    xr = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="rotary: inputs on several devices: x on cpu, cos on cpu, sin on meta"):
        rotary(xr, torch.zeros(3, 8), torch.zeros(3, 8, device="meta"))


@pytest.mark.parametrize("value, on", [("1", True), ("y", True), ("Y", True), ("yes", True), ("TRUE", True),
                                       ("on", True), ("0", False), ("no", False), ("", False)])
def test_interpreting_reads_triton_interpret_as_triton_does(monkeypatch, value, on):
    import kernels

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert kernels.interpreting() is on


def test_a_launch_runs_on_its_tensors_gpu(monkeypatch):
    """KernelCall enters the device of its first tensor argument before launching (an RPC
    thread starts on GPU 0 whatever GPU its engine serves). Fakes, as no GPU is here: a tensor
    reporting cuda:1, torch.cuda.device recorded instead of entered, a kernel that records
    the device current at its launch."""
    class OnGpu1(torch.Tensor):
        device = property(lambda self: torch.device("cuda", 1))

    current = [torch.device("cuda", 0)]

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], d
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch.cuda, "device", device)
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, current[0], kw))

    x = torch.zeros(2).as_subclass(OnGpu1)
    _launch.KernelCall(Kernel(), (3,), (7, x), dict(N=4), dict(num_warps=2))()
    assert launched == [((3,), torch.device("cuda", 1), dict(N=4, num_warps=2))]
    assert current[0] == torch.device("cuda", 0)
