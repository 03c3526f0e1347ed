"""Chunked prefill (``EngineConfig.enable_chunked_prefill``, vLLM's name and default): a prompt
longer than what is left of ``max_prefill_tokens`` is computed over several steps, the running
batch decoding between the chunks. Outputs equal full recomputation, also with shared group
prompts, preemption in the middle of a prefill and the C++ attention backend."""
import pytest
from test_engine import (_cpu_kernel_or_skip, check_against_recompute, engine, greedy_requests,
                         prompts)

from workers.generation.generate_all import generate_all

LONG = prompts([41, 3, 26, 57, 9, 18], seed=5)


def generate_checked(eng, reqs):
    """generate_all, checking after every step what the scheduler relies on: at most one running
    sequence has an unfinished prefill, and it is the last one admitted."""
    out = eng.add(reqs)
    while eng.has_work():
        out += eng.step()
        running = eng.scheduler.running
        partial = [s for s in running if eng.scheduler.prefilling(s)]
        assert partial == ([running[-1]] if partial else []), [s.request.sample_id for s in partial]
        assert eng.scheduler.partial() is (partial[0] if partial else None)
    return sorted(out, key=lambda s: s.sample_id)


@pytest.mark.parametrize("budget", [1, 7, 16])
@pytest.mark.parametrize("attention", ["torch", "cpu"])
def test_chunked_prefill_equals_recompute(budget, attention):
    if attention == "cpu":
        _cpu_kernel_or_skip()
    reqs = greedy_requests(LONG, 9)
    eng = engine(max_prefill_tokens=budget, max_batch_size=4, attention_backend=attention)
    out = generate_checked(eng, reqs)
    check_against_recompute(reqs, out)
    assert eng.stats().kv_blocks_used == 0 and not eng.scheduler.running


@pytest.mark.parametrize("kv_tokens", [4096, 128])
def test_chunked_prefill_with_shared_prompts_and_preemption(kv_tokens):
    # the group's first sample prefills its prompt in chunks; its siblings share the prompt only
    # once every chunk is in the cache; with a small cache, sequences (also ones still
    # prefilling, whose unfinished pin is dropped) are preempted and recomputed
    ps = prompts([30, 23, 45], seed=7)
    group_of = [i // 3 for i in range(9)]
    reqs = greedy_requests([ps[g] for g in group_of], 8, group_of)
    # 128 tokens, chunks of 4: a group's first sample is preempted in the middle of its prompt
    eng = engine(kv_cache_tokens=kv_tokens, max_batch_size=9, max_prefill_tokens=4)
    got = generate_checked(eng, reqs)
    check_against_recompute(reqs, got)
    assert eng.stats().kv_blocks_used == 0 and not eng.prefix.groups
    if kv_tokens == 128:
        assert eng.stats().preemptions > 0


def _step_kinds(eng, steps):
    """The next ``steps`` steps as "P<n>" / "D<n>": prefill or decode, n sequences sampled."""
    kinds, run = [], eng.runner.run

    def record(batch):
        kinds.append(("P" if batch.is_prefill else "D") + str(len(batch.sampling)))
        return run(batch)

    eng.runner.run = record
    for _ in range(steps):
        eng.step()
    eng.runner.run = run
    return kinds


def test_running_batch_decodes_between_the_chunks_of_a_long_prompt():
    short, long_ = prompts([3, 40], seed=2)
    eng = engine(max_prefill_tokens=8, max_batch_size=4)
    eng.add(greedy_requests([short], 30))
    eng.step()  # prefill the short prompt: it is decoding from now on
    assert len(eng._live[0].tokens) == 4
    long_req = greedy_requests([short, long_], 5)[1]
    eng.add([long_req])
    kinds = _step_kinds(eng, 10)
    # 40 prompt tokens in chunks of 8: five prefill steps, a decode step after each unfinished one
    assert kinds == ["P0", "D1", "P0", "D1", "P0", "D1", "P0", "D1", "P1", "D2"], kinds
    rest = generate_all(eng, [])
    check_against_recompute([long_req], [s for s in rest if s.sample_id == 1])


def test_without_chunking_a_long_prompt_is_prefilled_whole():
    short, long_ = prompts([3, 40], seed=2)
    eng = engine(max_prefill_tokens=8, max_batch_size=4, enable_chunked_prefill=False)
    eng.add(greedy_requests([short], 30))
    eng.step()
    eng.add([greedy_requests([short, long_], 5)[1]])
    assert _step_kinds(eng, 2) == ["P1", "D2"]
    out = generate_all(eng, [])
    assert sorted(len(s.output_ids) for s in out) == [5, 30]


def test_preempting_a_prompt_mid_prefill_drops_its_unready_pin():
    # the pin of a prompt still being prefilled holds K/V nobody will finish writing: preempting
    # its owner drops it, so the owner (or a sibling) computes the prompt afresh when re-admitted
    # instead of waiting for a pin that can never become ready
    p = prompts([30], seed=7)[0]
    reqs = greedy_requests([p, p], 4, [0, 0])
    eng = engine(max_prefill_tokens=8)
    eng.add(reqs)
    eng.step()  # the group's first chunk: pinned, not ready
    owner = eng.scheduler.running[0]
    assert eng.scheduler.prefilling(owner) and not eng.prefix.groups[0].ready
    eng.scheduler.preempt(owner)
    assert 0 not in eng.prefix.groups
    got = sorted(generate_all(eng, []), key=lambda s: s.sample_id)
    check_against_recompute(reqs, got)
