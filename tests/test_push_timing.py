"""``time/weight_sync_s``: a weight push is timed from its start to its last call's completion,
however late the controller waits for it (async modes wait after the next generation; the
row then held the generation's time too: 0.735 s logged for a 25 ms push)."""
from types import SimpleNamespace

import torch

from controller import batch
from controller.rpc import Call


def test_a_push_is_timed_to_its_last_completion_not_to_the_wait(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(batch.time, "time", lambda: now[0])
    futs = [torch.futures.Future(), torch.futures.Future()]
    calls = [Call(SimpleNamespace(rank=r, role="generation", name=f"worker{r}"), "receive_weights", f)
             for r, f in ((1, futs[0]), (2, futs[1]))]
    waited = []
    prog = SimpleNamespace(_wait_push=lambda w: waited.append(sorted(w.next()[2] for _ in range(w.pending))))
    push = batch.Push(calls)  # started at 100.0
    now[0] = 100.02
    futs[0].set_result(1)
    now[0] = 100.05
    futs[1].set_result(2)
    now[0] = 107.5  # the controller gets to it after a whole generation
    assert abs(push.wait(prog) - 0.05) < 1e-9
    assert waited == [[1, 2]]  # waited through Program._wait_push (lost instances leave the SGS)


def test_no_push_takes_no_time():
    prog = SimpleNamespace(_wait_push=lambda cs: None)
    assert batch.Push([]).wait(prog) == 0.0
