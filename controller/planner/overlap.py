"""Generation as the runtime runs it, for the shared-host A/B slowdowns (``host.concurrent_slowdown``).

The runtime's instance generates through ``GenerationInstance.generate``: engine steps plus the
Outbox thread pickling and sending every finished sample (a thread hand-off and a GIL switch
per window). ``generate_timer`` times one synthetic iteration of a workload's shapes that way
(the measured side of an A/B); ``runtime_engine_load`` runs such iterations over and over in a
spawned process (the background side). A bare engine loop has neither the hand-offs nor the
sleeps, and the scheduler treats a thread that sleeps now and then differently from a pure
compute loop.
"""
from __future__ import annotations

import time
from typing import Callable

import torch



def generate_timer(engine_cfg, model_dir: str, out_lens: list[int], prompt_lens: list[int], window_s: float = 0.02,
                   vocab: int = 300, seed: int = 0) -> Callable[[], float]:
    """A callable: seconds of one ``GenerationInstance.generate`` over requests of these shapes
    (forced lengths, random prompt ids in [3, vocab)), samples pickled as the RPC would."""
    from controller.instance import GenerationInstance
    from controller.planner.host import PickleReceiver, model_vocab, synthetic_requests

    if not out_lens or len(out_lens) != len(prompt_lens):
        raise ValueError(f"generate_timer: {len(out_lens)} out_lens, {len(prompt_lens)} prompt_lens")
    gen = torch.Generator().manual_seed(seed)
    inst = GenerationInstance(0, engine_cfg, model_dir, stream_window_s=window_s)
    vocab = min(vocab, model_vocab(model_dir))  # an in-process BPE may hold fewer tokens
    sink = PickleReceiver()
    inst.trainers = [sink]
    next_id = [90_000_000]

    def run() -> float:
        reqs = synthetic_requests(out_lens, prompt_lens, gen, next_id, vocab)
        t0 = time.perf_counter()
        inst.generate(0, reqs, inst.version)
        dt = time.perf_counter() - t0
        sink.expect(reqs)  # a path that skipped the work or the stream would time nothing real
        return dt

    run.sink = sink
    return run


def runtime_engine_load(engine_cfg, model_dir: str, out_lens: list[int], prompt_lens: list[int], window_s: float,
                        gate) -> None:
    """Background workload: ``generate_timer`` iterations over and over (generation's demand
    as the runtime makes it), paused and resumed through ``gate`` (host.concurrent_slowdown)."""
    from controller.planner.host import serve

    torch.set_num_threads(1)
    serve(gate, generate_timer(engine_cfg, model_dir, out_lens, prompt_lens, window_s))
