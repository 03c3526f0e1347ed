"""Controller behaviour the rest of the suite let through when changed by one line (mutation review,
session 58): a resumed run trains only the iterations left, a run ending past its last ckpt_every
save writes its own final checkpoint, a trainer lost during a save is the lost worker, a joiner
added at version 0 holds the weights it pulled, a custom dispatcher's broken plans are refused, a
checkpoint keeps the rewards before it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from controller import checkpoint as ckpt
from runtime_helpers import LocalRRef, iterations, last_json, tiny_model, torchrun, write_config  # noqa: F401
from test_checkpoint_retention import _session


def test_a_run_ending_past_its_last_ckpt_every_save_writes_its_own_final_checkpoint(tmp_path):
    """ckpt_every saved iteration 4 and the run ended at 5: the run's checkpoint is iteration 5's,
    not iteration 4's named again (the fifth iteration's update would be lost). The trainer's
    save is the retention tests' stand-in (a file per folder), the Session's save is real."""
    s = _session(tmp_path, keep=None)
    s._saved = None
    four = s.save_checkpoint(4)
    s.program.iteration = 5
    final = s.final_checkpoint()
    assert final == tmp_path / "run" / "checkpoints" / "iter_000005" and final != four
    assert ckpt.load_state(final).iteration == 5 and ckpt.find(tmp_path / "run") == final


def test_a_checkpoint_keeps_the_rewards_of_the_iterations_before_it_only(tmp_path):
    """A step that trained nothing is saved to be retried (Session._stop_untrained: next
    iteration = that step), its reward already logged: the resumed retry logs it again, so
    the checkpoint must not hold it (reward_first / reward_last would count it twice)."""
    s = _session(tmp_path, keep=None)
    s.metrics.rewards = [0.1, 0.2, 0.3, 0.4]
    saved = s.save_checkpoint(3)
    assert ckpt.load_state(saved).rewards == [0.1, 0.2, 0.3]


def test_a_trainer_lost_during_a_save_is_the_lost_worker_not_a_failed_write(tmp_path):
    """A trainer process gone mid-save is a lost worker (the runner then exits the local way,
    no lock-step exit with a dead rank), not a "could not be written" RunStopped. The trainer
    handle is a stand-in whose call fails as a lost peer's does (a real one needs a killed rank)."""
    from controller.rpc import WorkerFailed
    from controller.stops import RunStopped

    class Lost:
        def call(self, name, folder):
            done = torch.futures.Future()
            done.set_result(None)

            def wait(cancelled=None):
                raise WorkerFailed(2, "trainer", name, "EOF: connection closed by peer", lost=True)
            return SimpleNamespace(wait=wait, future=done, method=name,
                                   handle=SimpleNamespace(rank=2, role="trainer", name="worker2"))

    s = _session(tmp_path, keep=None)
    s.world.trainers[:] = [Lost()]
    try:
        s.save_checkpoint(2)
    except RunStopped as e:
        pytest.fail(f"a lost trainer was said as a failed write: {e}")
    except WorkerFailed as e:
        assert e.lost and e.rank == 2


@pytest.mark.parametrize("per, caps, said", [
    ([[0, 1], [1]], [1, 1], r"twice \[1\]"),  # request 1 generated and trained twice
    ([[0], [1], []], [1, 1], "3 request lists and 2 batch caps for 2 instances"),
    ([[0], [1]], [0, 1], r"batch caps must be ints >= 1, got \[0\]"),  # an instance that may run nothing
])
def test_a_plan_that_doubles_a_request_or_cannot_run_is_refused(per, caps, said):
    from controller.own_dispatcher import checked_plan
    from controller.scheduling import DispatchPlan

    with pytest.raises(ValueError, match=said):
        checked_plan(DispatchPlan(per, caps, "mine"), 2, 2, "mine")


def test_a_joiner_added_at_version_0_holds_the_weights_it_pulled(tiny_model, monkeypatch):  # noqa: F811
    """add_instance on one process: the joiner's transport is a LocalRRef (a real joiner needs a
    running job's RPC group), the instance, its engine and its weight pull are real; the trainer
    answers weights_for with the folder's weights + 0.01. Added at version 0 it must generate
    from the run's weights, not its own folder's (staged v0 is never swapped in at a round)."""
    from controller import rpc as crpc
    from controller import world as cworld
    from controller.config import from_dict
    from controller.rpc import WorkerHandle
    from controller.trainer_address import TrainerAddress

    cfg = from_dict({"engine": {"device": "cpu", "kv_cache_tokens": 1024, "max_batch_size": 4},
                     "placement": {"generation": [1], "trainer": [2]}}, world_size=3)
    made = {}

    def create(rank, role, cls, *args, timeout):
        made["inst"] = cls(*args)
        return WorkerHandle(rank, role, LocalRRef(made["inst"]), timeout)

    class Trainer:
        def weights_for(self, version, dtype):
            made["sent"] = {k: v.detach() + 0.01 for k, v in made["inst"].engine.model.named_parameters()}
            return made["sent"]

    class LocalTrainer(TrainerAddress):  # the trainer rank's address, its calls run here
        def rpc_async(self, timeout=-1.0):
            return LocalRRef(Trainer())

    monkeypatch.setattr(cworld, "create", create)
    monkeypatch.setattr(crpc, "call_on", lambda rank, role, fn, args=(), timeout=None: fn(*args))
    added = []
    world = cworld.World([WorkerHandle(2, "trainer", LocalTrainer("worker2"))],
                         SimpleNamespace(add=lambda h, prof: added.append(h)), False, {1, 2})
    h = cworld.add_instance(world, cfg, 3, tiny_model, [0], 0)
    assert added == [h]
    params = dict(made["inst"].engine.model.named_parameters())
    assert all(torch.equal(params[k], w) for k, w in made["sent"].items())


def test_a_resumed_run_trains_only_the_iterations_left(tmp_path, tiny_model):  # noqa: F811
    """iterations 1, then --resume with iterations 2: one more iteration, not two."""
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=1, train__eval_every=0))
    assert p.returncode == 0, p.stderr[-3000:]
    p = torchrun(write_config(tmp_path, tiny_model, train__iterations=2, train__eval_every=0),
                 extra=["--resume", str(tmp_path / "run")])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["iteration"] for r in iterations(tmp_path / "run")] == [0, 1]
    assert last_json(p.stdout)["iterations"] == 2
