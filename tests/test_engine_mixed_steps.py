"""Mixed steps (vLLM V1's): with the "cpu" attention kernel, which takes any ragged mix of
tokens, one step decodes every running sequence and computes the prefill work its budget
allows (new admissions, the next chunk of a long prompt). The outputs equal recomputation as
separate steps' do; the running batch is never left out of a step while something is admitted."""
import pytest
import torch
from test_engine import check_against_recompute, engine, greedy_requests, groups_and_solos, prompts
from test_engine import _cpu_kernel_or_skip as cpu_kernel_or_skip

from workers.generation.generate_all import generate_all
from workers.types import Request, SamplingParams

PS = prompts([3, 9, 21, 5, 14, 2, 30, 7, 11, 4, 17, 6], seed=5)


@pytest.fixture(autouse=True)
def _kernel():
    cpu_kernel_or_skip()


def traced(eng):
    """Record every scheduled batch: (ids decoding, ids prefilling) per step."""
    steps, schedule = [], eng.scheduler.schedule

    def spy():
        batch = schedule()
        if batch is not None:
            pre = {s.request.sample_id for s, e in zip(batch.seqs, batch.ends)
                   if e - s.num_cached > 1 or s.num_tokens == s.prompt_len}
            steps.append(([s.request.sample_id for s in batch.seqs if s.request.sample_id not in pre], sorted(pre)))
        return batch

    eng.scheduler.schedule = spy
    return steps


def test_admissions_ride_on_decode_steps_and_outputs_equal_recompute():
    reqs = [Request(sample_id=i, prompt_ids=p, max_tokens=6 + i % 5, min_tokens=6 + i % 5,
                    sampling=SamplingParams(temperature=0.0)) for i, p in enumerate(PS)]
    eng = engine(attention_backend="cpu", max_batch_size=4)
    assert eng.scheduler.mixed
    steps = traced(eng)
    out = generate_all(eng, reqs)
    check_against_recompute(reqs, out)
    mixed = [s for s in steps if s[0] and s[1]]
    assert len(mixed) >= 4, steps  # admissions as sequences finish, in the decode steps
    assert not [s for s in steps[1:] if not s[0]], steps  # after the first, every step decodes
    # fewer steps than separate prefill and decode steps take for the same work
    sep = engine(attention_backend="cpu", max_batch_size=4)
    sep.scheduler.mixed = False
    sep_steps = traced(sep)
    check_against_recompute(reqs, generate_all(sep, reqs))
    assert len(steps) < len(sep_steps) - 4, (len(steps), len(sep_steps))


def test_a_long_prompt_is_chunked_beside_the_running_batch():
    long = prompts([60], seed=9)[0]
    reqs = greedy_requests(PS[:3], 20) + [Request(sample_id=3, prompt_ids=long, max_tokens=8, min_tokens=8,
                                                 sampling=SamplingParams(temperature=0.0))]
    eng = engine(attention_backend="cpu", max_batch_size=4, max_prefill_tokens=16)
    steps = traced(eng)
    eng.add(reqs[:3])
    out = eng.step() + eng.step() + eng.step() + eng.step()  # the three admitted (33 tokens in chunks), then decoding
    assert steps[-1] == ([0, 1, 2], [])
    eng.add(reqs[3:])
    while eng.has_work():
        out += eng.step()
    out.sort(key=lambda s: s.sample_id)
    check_against_recompute(reqs, out)
    chunks = [s for s in steps if 3 in s[1]]
    assert chunks == [([0, 1, 2], [3])] * 4, steps  # 60 tokens in chunks of 16, each beside the three decodes


def test_with_preemption_group_sharing_and_prefix_caching():
    reqs = groups_and_solos(PS[:6])
    eng = engine(attention_backend="cpu", kv_cache_tokens=96, max_batch_size=6)
    steps = traced(eng)
    out = generate_all(eng, reqs)
    assert eng.stats().preemptions > 0 and [s for s in steps if s[0] and s[1]]
    check_against_recompute(reqs, out)


def test_seeded_sampling_does_not_depend_on_how_steps_are_mixed():
    reqs = [Request(sample_id=i, prompt_ids=p, max_tokens=10, sampling=SamplingParams(temperature=1.0, seed=100 + i))
            for i, p in enumerate(PS)]
    outs = []
    for mixed in (True, False):
        eng = engine(attention_backend="cpu", max_batch_size=3)
        eng.scheduler.mixed = mixed
        outs.append(sorted(generate_all(eng, reqs), key=lambda s: s.sample_id))
    for a, b in zip(*outs):
        assert a.output_ids.tolist() == b.output_ids.tolist()
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)


def test_other_attention_backends_keep_separate_steps():
    assert not engine(attention_backend="torch").scheduler.mixed  # its prefill pads every sequence to the longest
