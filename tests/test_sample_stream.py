"""How samples travel from a generation instance to a trainer rank, without processes: the
instance's outbox (time windows, one RPC per trainer, a failed send said) and the trainer
rank's release policies (``stream``: a chunk of tokens or the end; ``all``: the end of
generation)."""


class _FakeTrainer:
    """Stands in for a trainer RRef (``rref.rpc_async().receive(samples)``): records each call.
    A unit test of the Outbox's windowing and per-trainer chunking; the real RPC stream is run
    end to end by tests/test_repl.py and tests/test_multinode.py."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def rpc_async(self):
        return self

    def receive(self, samples):
        import torch

        self.calls.append([s.sample_id for s in samples])
        fut = torch.futures.Future()
        fut.set_result(len(samples))
        return fut


def _sample(sid: int, group: int):
    import torch

    from workers.types import Sample

    ids = torch.tensor([1, 2, 3])
    return Sample(sid, ids, ids, torch.zeros(3), 0, "length", group)


def test_outbox_sends_windowed_chunks_per_trainer_and_flushes_on_close():
    from controller.outbox import Outbox

    trainers = [_FakeTrainer(), _FakeTrainer()]
    out = Outbox(trainers, window_s=60.0)  # one window covers the whole test
    for sid in range(6):
        out.put(_sample(sid, group=sid // 2))  # groups 0, 1, 2 -> trainers 0, 1, 0
    out.close()  # sends what is left at once, without waiting for the window to end
    assert trainers[0].calls == [[0, 1, 4, 5]] and trainers[1].calls == [[2, 3]]
    assert out.sends == 2
    out = Outbox(trainers[:1], window_s=0.0)  # no window: one RPC per queued sample run
    out.put(_sample(9, 0))
    out.close()
    assert trainers[0].calls[-1] == [9]


def test_an_outbox_whose_send_fails_says_so_and_loses_nothing_quietly():
    """A send that raises in the sending thread (a sample RPC cannot carry, RPC shutting down)
    used to end that thread with a printed traceback: close() returned, generate() reported the
    samples done, and the trainer waited for them for ever (concurrency audit, session 19)."""
    import pytest

    from controller.outbox import Outbox

    class Refusing(_FakeTrainer):
        def receive(self, samples):
            raise RuntimeError("cannot pickle the sample")

    out = Outbox([Refusing()], window_s=0.0)
    out.put(_sample(1, 0))
    out.thread.join(timeout=30)  # the thread ends on the failed send
    with pytest.raises(RuntimeError, match="sending samples to the trainers failed.*cannot pickle"):
        out.put(_sample(2, 0))
    with pytest.raises(RuntimeError, match="sending samples to the trainers failed.*cannot pickle"):
        out.close()


def test_stream_release_waits_for_a_chunk_of_tokens_or_the_end():
    from controller.trainer_inbox import IterationInbox

    rec = IterationInbox(0, {i: None for i in range(5)}, {}, "stream", 1, 0, stream_tokens=15)

    def arrive(sid):  # 3 prompt + 3 output tokens each
        s = _sample(sid, sid)
        rec.pending.append(s)
        rec.pending_tokens += 6

    arrive(0)
    arrive(1)
    assert rec.release() == []  # 12 < 15 tokens: keep collecting
    arrive(2)
    assert [s.sample_id for s in rec.release()] == [0, 1, 2] and rec.pending_tokens == 0
    rec.consumed = 3
    arrive(3)
    arrive(4)
    assert [s.sample_id for s in rec.release()] == [3, 4]  # the iteration is complete: no waiting
    single = IterationInbox(1, {9: None, 10: None}, {}, "stream", 1, 0, stream_tokens=0)
    single.pending.append(_sample(9, 9))
    assert len(single.release()) == 1  # 0: every sample at once


def test_all_release_waits_for_the_end_of_generation_not_only_this_ranks_share():
    """colocated / batch / async_batch: generate all, then train all. A rank whose own groups
    are complete waits for step() (called once generation ended on every instance): colocated,
    the instance in its process is still generating the other ranks' samples."""
    from controller.trainer_inbox import IterationInbox

    rec = IterationInbox(0, {0: None, 1: None}, {}, "all", 1, 0)
    rec.pending += [_sample(0, 0), _sample(1, 1)]
    assert rec.release() == []  # this rank's share is complete, generation is not over
    rec.generated = True
    assert [s.sample_id for s in rec.release()] == [0, 1]


def test_the_all_release_hands_over_in_sample_id_order_not_arrival_order():
    """colocated / batch / async_batch trained the samples in the order RPC timing brought them:
    two runs of one config (and a resume against the run it continues) ended on other weights
    (review, session 50)."""
    from controller.trainer_inbox import IterationInbox

    rec = IterationInbox(0, {i: None for i in range(4)}, {}, "all", 1, 0)
    rec.pending += [_sample(2, 1), _sample(0, 0), _sample(3, 1), _sample(1, 0)]
    rec.generated = True
    assert [s.sample_id for s in rec.release()] == [0, 1, 2, 3]


def test_an_outbox_sends_to_a_trainer_one_call_at_a_time():
    """Two windows' sends to one trainer in flight together could be served in either order by its
    RPC threads: the next waits for the one before."""
    import threading

    import torch

    from controller.outbox import Outbox

    class Slow(_FakeTrainer):
        def __init__(self):
            super().__init__()
            self.open: list = []
            self.overlapped = False

        def receive(self, samples):
            self.overlapped |= any(not f.done() for f in self.open)
            self.calls.append([s.sample_id for s in samples])
            fut = torch.futures.Future()
            self.open.append(fut)
            threading.Timer(0.05, fut.set_result, (None,)).start()  # served a little later
            return fut

    t = Slow()
    out = Outbox([t], window_s=0.0)
    for sid in range(4):
        out.put(_sample(sid, 0))
        threading.Event().wait(0.01)
    out.close()
    assert sum(t.calls, []) == [0, 1, 2, 3] and len(t.calls) >= 2 and not t.overlapped
