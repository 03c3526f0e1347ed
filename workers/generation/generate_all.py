"""``generate_all``: every request through an engine (any ``Engine``: the native one, vLLM),
stepped until idle, the samples back in request order: the batch way to use an engine
(benchmarks, tests, the examples of docs/engine.md); the generation worker streams instead."""
from __future__ import annotations

from typing import Callable, Sequence as Seq

from workers.generation.request_check import hashable
from workers.types import Engine, Request, Sample


def generate_all(engine: Engine, requests: Seq[Request],
                 on_sample: Callable[[Sample], None] | None = None) -> list[Sample]:
    """Add ``requests``, step until the engine is idle; ``on_sample`` is called with each
    sample as it finishes (refusals first). Returns the samples in the order of ``requests``
    (samples of requests added earlier by someone else are passed to ``on_sample`` and
    returned after them). Requests that repeat a sample id are added in a later ``add`` than
    the first, so each refusal is its own request's (a refused duplicate came out before the
    sample of the request it repeated; review, s54)."""
    requests = list(requests)
    keyed: list[tuple[int, Sample]] = []
    served: dict = {}  # sample id -> the index of the request the engine took
    last = len(requests)

    def emit(samples: list[Sample], key) -> None:
        for s in samples:
            keyed.append((key(s), s))
            if on_sample is not None:
                on_sample(s)

    for chunk in _unique_id_chunks(requests):
        at = {_id_key(r.sample_id): i for i, r in chunk}
        refused = engine.add([r for _, r in chunk])
        emit(refused, lambda s: at.get(_id_key(s.sample_id), last))
        no = {s.sample_id for s in refused if hashable(s.sample_id)}
        for i, r in chunk:
            if hashable(r.sample_id) and r.sample_id not in no:
                served.setdefault(r.sample_id, i)
    while engine.has_work():
        emit(engine.step(), lambda s: served.get(s.sample_id, last) if hashable(s.sample_id) else last)
    return [s for _, s in sorted(keyed, key=lambda x: x[0])]


def _id_key(sample_id):
    """A sample id as a dict key (an unhashable one, which ``add`` refuses, by its object)."""
    return sample_id if hashable(sample_id) else ("unhashable", id(sample_id))


def _unique_id_chunks(requests: list[Request]) -> list[list[tuple[int, Request]]]:
    """``requests`` (with their indices) cut where a sample id repeats one of its chunk's."""
    chunks, ids = [[]], set()
    for i, r in enumerate(requests):
        key = _id_key(r.sample_id)
        if key in ids:
            chunks.append([])
            ids = set()
        ids.add(key)
        chunks[-1].append((i, r))
    return [c for c in chunks if c] or [[]]
