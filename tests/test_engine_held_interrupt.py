"""A Ctrl-C outside the forward (admission, the step's bookkeeping) is held until the engine's
structures agree again, then raised (``workers/generation/held_interrupt.py``). Landing between
two of those changes it left a sample running past ``max_tokens``, a group prompt's pin never
ready (its siblings waited forever), or a queued sequence holding blocks that failed every
later step (review, session 52). Each test delivers a real SIGINT to this process at that point;
stepping on, the outputs equal those of an engine never interrupted and every block is free."""
import signal
import threading

import pytest
import torch

from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.generation.token_rate import TokenRate
from workers.generation.held_interrupt import HeldInterrupt
from workers.model import CausalLM, ModelConfig, init_weights
from workers.types import Request, SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)
MODEL = init_weights(CausalLM(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=128)), seed=3, std=0.2).eval()


def engine() -> NativeEngine:
    return NativeEngine(EngineConfig(block_size=4, num_blocks=100, max_batch_size=8, eos_ids=(),
                                     attention_backend="torch"), model=MODEL)


def ctrl_c_at(obj, name: str, after: bool = False, call: int = 1):
    """``obj.name`` delivers one SIGINT to this process (a Ctrl-C) before (or after) its
    ``call``-th call."""
    orig, fired, calls = getattr(obj, name), [], []

    def wrapped(*a, **kw):
        calls.append(1)
        if len(calls) == call and not after:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        out = orig(*a, **kw)
        if len(calls) == call and after:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        return out
    setattr(obj, name, wrapped)
    return fired


def step_through(eng: NativeEngine, limit: int = 200) -> tuple[list, int]:
    out, interrupts = [], 0
    for _ in range(limit):
        if not eng.has_work():
            break
        try:
            out += eng.step()
        except KeyboardInterrupt:
            interrupts += 1
    return sorted(out, key=lambda s: s.sample_id), interrupts


def reference(reqs):
    return [s.output_ids.tolist() for s in generate_all(engine(), reqs)]


@pytest.mark.parametrize("where", ["_count_tokens", "mark_ready", "prepare_write"])
def test_a_ctrl_c_outside_the_forward_leaves_the_engine_whole(where):
    if where == "mark_ready":  # a group prompt's prefill: its siblings wait for the pin
        reqs = [Request(i, torch.arange(1, 11), 4, group_id=5, sampling=GREEDY) for i in range(3)]
    else:
        reqs = [Request(i, torch.tensor([1 + i, 2, 3, 4, 5, 6, 7]), 3 + i, sampling=GREEDY) for i in range(3)]
    eng = engine()
    eng.add(reqs)
    target = {"_count_tokens": eng, "mark_ready": eng.prefix, "prepare_write": eng.bm}[where]
    # _count_tokens: at the third step, where sample 0 reaches its max_tokens 3
    fired = ctrl_c_at(target, where, after=where == "prepare_write", call=3 if where == "_count_tokens" else 1)
    out, interrupts = step_through(eng)
    assert fired and interrupts == 1  # raised once the step's bookkeeping was done
    assert [s.sample_id for s in out] == [0, 1, 2] and not eng.has_work()
    assert [s.output_ids.tolist() for s in out] == reference(reqs)
    assert all(len(s.output_ids) == r.max_tokens for s, r in zip(out, reqs))
    assert eng.stats().kv_blocks_used == 0


def test_interrupts_are_held_only_on_the_main_thread_under_pythons_handler():
    got = []
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt():
            signal.raise_signal(signal.SIGINT)
            got.append("ran on")
    assert got == ["ran on"]
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt() as held:
            with held.interruptible():
                signal.raise_signal(signal.SIGINT)
                got.append("not reached")
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt() as held:
            signal.raise_signal(signal.SIGINT)
            got.append("held")
            with held.interruptible():  # a held one is raised on entry
                got.append("not reached")
    assert got == ["ran on", "held"]
    previous = signal.signal(signal.SIGINT, lambda *a: got.append("own handler"))
    try:
        with HeldInterrupt():
            signal.raise_signal(signal.SIGINT)
        assert got[-1] == "own handler"
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    seen = []
    t = threading.Thread(target=lambda: seen.append(_held_on_thread()))
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]  # a thread changes no handler (it may not)


def _held_on_thread():
    with HeldInterrupt():
        return signal.getsignal(signal.SIGINT)


def test_the_token_rate_is_read_while_steps_add_to_it():
    """``stats()`` reads it on an RPC thread while ``step()`` adds: both trimmed the window (an
    IndexError inside a step, or a running sum wrong from then on)."""
    rate, stop, errors = TokenRate(horizon=0.001), threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                rate.rate(rate.window[-1][0] + 0.002 if rate.window else 0.0)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200_000):
            rate.add(i * 0.0005, 1, i * 0.0005 - 0.0001)
    finally:
        stop.set()
        t.join()
    assert not errors
    assert rate._after_first == sum(n for _, n in list(rate.window)[1:])


def test_an_unhashable_sample_id_is_refused_and_aborting_it_changes_nothing():
    eng = engine()
    reqs = [Request(0, torch.tensor([1, 2, 3]), 2, sampling=GREEDY), Request([1], torch.tensor([1, 2]), 2),
            Request(2, torch.tensor([4, 5]), 2, sampling=GREEDY)]
    assert eng.abort([[1], 0]) == []  # (was a TypeError)
    out = generate_all(eng, reqs)  # was a TypeError after serving the batch: every sample lost
    assert [s.sample_id for s in out] == [0, [1], 2]
    assert out[1].finish_reason == "error" and "sample_id must be an int, got list [1]" in out[1].error
    eng.add(reqs[:1] + reqs[2:])
    assert eng.abort([0, [1], 2]) == [0, 2] and not eng.has_work()
