"""Weight sync sends the weights in the dtype the engines keep them in: a bf16 engine was sent
the trainer's fp32 masters (twice the bytes over the links the paper's cross-datacenter sync is
about, and a full fp32 copy on the trainer's GPU under NCCL) and rounded them itself (review,
s55). The rounding is the same either way: sent as bf16 or rounded on arrival, the engine holds
``master.to(bf16)``."""
import threading

import torch

from workers.weight_sync import wire_dtype
from runtime_helpers import TASK, iterations, tiny_model, torchrun, write_config  # noqa: F401


def test_the_wire_dtype_is_the_engines_or_the_widest_or_the_trainers():
    assert wire_dtype(["torch.bfloat16", "torch.bfloat16"]) == "torch.bfloat16"
    assert wire_dtype(["torch.bfloat16", "torch.float32"]) == "torch.float32"  # each gets what it keeps
    assert wire_dtype(["torch.bfloat16", "torch.float16"]) is None  # only fp32 holds both exactly
    assert wire_dtype(["torch.bfloat16", None]) is None  # an engine that does not say: the trainer's
    assert wire_dtype([]) is None
    for odd in ("torch.int8", "torch.float8_e4m3fn", "auto", "bf16"):  # a user's engine: not sent as that
        assert wire_dtype([odd]) is None and wire_dtype(["torch.bfloat16", odd]) is None, odd


def test_a_trainer_rank_sends_its_masters_rounded_to_the_plans_dtype(tiny_model, monkeypatch):  # noqa: F811
    import workers.weight_sync
    from controller.trainer_rank import TrainerRank
    from workers.trainer import TrainerConfig
    from workers.weight_sync import Topology, plan_sync

    sent = {}

    class Capture:
        def __init__(self, *a, **kw):
            pass

        def push(self, named, version):
            sent.update(named)

    monkeypatch.setattr(workers.weight_sync, "WeightSyncSender", Capture)
    rank = TrainerRank(0, [0], TrainerConfig(algorithm="grpo"), tiny_model, "synthetic", TASK)
    try:
        masters = dict(rank.worker.named_weights())
        spec = rank.tensor_spec("torch.bfloat16")
        assert {s.dtype for s in spec} == {torch.bfloat16} and [s.name for s in spec] == list(masters)
        assert {s.dtype for s in rank.tensor_spec()} == {torch.float32}
        plan = plan_sync(Topology(), [0], [1], spec, 1 << 20)
        fp32 = plan_sync(Topology(), [0], [1], rank.tensor_spec(), 1 << 20)
        assert plan.model_bytes() * 2 == fp32.model_bytes()
        pulled = rank.weights_for(rank.worker.version, "torch.bfloat16")  # a joiner's pull, in its engine's dtype
        assert all(v.dtype == torch.bfloat16 and torch.equal(v, masters[k].detach().to(torch.bfloat16))
                   for k, v in pulled.items())
        assert {v.dtype for v in rank.weights_for(rank.worker.version, "torch.int8").values()} == {torch.float32}
        t = threading.Thread(target=rank.push_weights, args=(plan, rank.worker.version))
        t.start()
        t.join(60)
        assert sent.keys() == masters.keys()
        for k, v in sent.items():
            assert v.dtype == torch.bfloat16 and torch.equal(v, masters[k].detach().to(torch.bfloat16)), k
    finally:
        rank.close()


def test_a_run_with_bf16_engines_sends_half_the_bytes_and_trains(tiny_model, tmp_path):  # noqa: F811
    """A real run (3 processes, gloo): the plan the controller describes carries bf16, the
    engines generate with every pushed version, and the run ends well."""
    fp32 = sum(t.numel() * 4 for t in _weights(tiny_model).values())
    cfg = write_config(tmp_path, tiny_model, engine__dtype="bfloat16", pipeline__mode="stream",
                       train__eval_every=0)
    p = torchrun(cfg)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stderr.splitlines() if "[controller] weight sync:" in ln)
    total = int(line.split(" B from roots")[0].rsplit(" ", 1)[1])
    assert fp32 // 2 <= total < fp32, line  # bf16 (with the buckets' alignment), not fp32
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert [r["gen_version"] for r in rows] == [0, 1, 2]  # each iteration generated with the version pushed to it


def _weights(folder):
    from workers.model import load_state

    return {k: v for k, v in load_state(folder).items() if "rotary" not in k}


def test_a_joiner_pulls_in_its_engines_dtype():
    """A scale-out joiner pulls the weights over RPC (outside the trees): it asks for its engine's
    dtype, so a bf16 joiner gets bf16 (diff review, s55: the argument was untested)."""
    from types import SimpleNamespace

    import torch.futures

    from controller.instance import GenerationInstance
    from controller.timeline import SpanRecorder

    asked = []

    class Trainer:
        def rpc_async(self, timeout):
            def weights_for(version, dtype=None):
                asked.append((version, dtype))
                fut = torch.futures.Future()
                fut.set_result({"w": torch.zeros(2, dtype=torch.bfloat16)})
                return fut
            return SimpleNamespace(weights_for=weights_for)

    inst = GenerationInstance.__new__(GenerationInstance)
    inst.rank, inst.spans, inst._staged, inst._staging = 5, SpanRecorder("gen5"), None, threading.Lock()
    inst.trainers, inst.engine = [Trainer()], SimpleNamespace(weight_dtype=torch.bfloat16)
    assert inst.pull_weights(3, 10.0) == 3
    assert asked == [(3, "torch.bfloat16")] and inst._staged[0] == 3
    inst.engine = SimpleNamespace()  # an engine that does not say: the trainer's dtype
    inst.pull_weights(4, 10.0)
    assert asked[-1] == (4, None)
