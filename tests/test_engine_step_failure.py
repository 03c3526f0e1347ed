"""A step that raises leaves the engine consistent: the failed batch's sequences go back to the
queue as preempted ones (blocks freed, tokens kept) and are recomputed when re-admitted.

The failure is injected where a real one would come from, inside the forward: the attention
of the second layer raises, after the first layer has written its K/V for the step (a
half-written step). Stepping on, every output equals that of an engine that never failed
(greedy, token for token), with prefix-shared groups, chunked prefill and both CPU attention
backends; at the end every block is free."""
import pytest
import torch

from workers.generation.attention import PagedAttention
from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.generation.sequence import Status
from workers.model import CausalLM, ModelConfig, init_weights
from workers.types import Request, SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)
V = 89
# 3 layers, one KV head of 64 (the C++ kernel's vectorised head size): a failure at layer 1
# leaves layer 0's K/V written for the step and layers 1-2's not
MODEL = init_weights(CausalLM(ModelConfig(
    vocab_size=V, hidden_size=128, intermediate_size=160, num_hidden_layers=3, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=256)), seed=1, std=0.2).eval()


class FailingAttention(PagedAttention):
    """The engine's own attention, raising ``error`` at layer 1 while ``armed`` (then disarming):
    layer 0 has written the step's K/V, the layers after it have not."""

    armed = False
    error: BaseException = RuntimeError("injected")

    def __call__(self, layer, q, k, v):
        if layer == 1 and self.armed:
            self.armed = False
            raise self.error
        return super().__call__(layer, q, k, v)


def engine(backend: str = "torch", **kw) -> NativeEngine:
    base = dict(block_size=4, kv_cache_tokens=4096, max_batch_size=8, attention_backend=backend)
    base.update(kw)
    return NativeEngine(EngineConfig(**base), model=MODEL)


def failing(backend: str = "torch", **kw) -> tuple[NativeEngine, FailingAttention]:
    eng = engine(backend, **kw)
    eng.runner.attn.__class__ = FailingAttention
    return eng, eng.runner.attn


def requests() -> list[Request]:
    """Mixed prompt lengths and a GRPO-like group of 3 sharing a 13-token prompt."""
    g = torch.Generator().manual_seed(0)
    solo = [Request(i, torch.randint(0, V, (3 + 5 * i,), generator=g), 9, 9, sampling=GREEDY) for i in range(4)]
    shared = torch.randint(0, V, (13,), generator=g)
    return solo + [Request(10 + j, shared, 7, 7, sampling=GREEDY, group_id=5) for j in range(3)]


def reference(backend: str = "torch", **kw) -> dict[int, list[int]]:
    return {s.sample_id: s.output_ids.tolist() for s in generate_all(engine(backend, **kw), requests())}


def step_through(eng: NativeEngine, attn: FailingAttention, fail_at: set[int], max_steps: int = 400):
    """Step until idle, arming the failure before the steps numbered in ``fail_at``; returns the
    outputs and how many steps failed."""
    out, failed = {}, 0
    for n in range(max_steps):
        if not eng.has_work():
            return out, failed
        if n in fail_at:
            attn.armed = True
            with pytest.raises(type(attn.error)):
                eng.step()
            failed += 1
            continue
        for s in eng.step():
            assert s.sample_id not in out
            out[s.sample_id] = s.output_ids.tolist()
    raise AssertionError(f"engine still has work after {max_steps} steps: {eng.stats()}")


def assert_all_free(eng: NativeEngine) -> None:
    st = eng.stats()
    assert (st.running, st.waiting, st.kv_blocks_used) == (0, 0, 0) and not any(eng.bm.ref)
    assert not eng.prefix.groups and not eng._live


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_outputs_after_failed_decode_and_prefill_steps_equal_a_clean_run(backend):
    eng, attn = failing(backend)
    eng.add(requests())
    # step 0: the first prefill (the group's owner computes its prompt); 3 and 6: decodes
    out, failed = step_through(eng, attn, {0, 3, 6})
    assert out == reference(backend)
    assert failed == 3
    assert_all_free(eng)
    assert eng.stats().preemptions == 0  # a requeue is not a memory preemption


def test_a_failed_step_requeues_its_batch_with_their_tokens():
    eng, attn = failing()
    eng.add(requests())
    for _ in range(4):
        eng.step()
    running = list(eng.scheduler.running)
    tokens = {s.request.sample_id: len(s.tokens) for s in running}
    attn.armed = True
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()  # a decode of the whole batch
    assert not eng.scheduler.running and eng.runner.attn.ctx is None
    for s in running:
        assert s.status is Status.WAITING and s.preempted and s.block_table == [] and s.num_cached == 0
        assert len(s.tokens) == tokens[s.request.sample_id]  # nothing appended, nothing lost
    # only the group's ready prompt pin holds blocks
    assert eng.stats().kv_blocks_used == sum(len(g.blocks) for g in eng.prefix.groups.values())


def test_a_failed_prefill_of_a_group_prompt_drops_its_unready_pin():
    eng, attn = failing(max_batch_size=8)
    eng.add(requests()[4:])  # the group alone: its owner's prefill is the first step
    attn.armed = True
    with pytest.raises(RuntimeError, match="injected"):  # the injected failure, not another error
        eng.step()
    assert 5 not in eng.prefix.groups and eng.stats().kv_blocks_used == 0
    out, _ = step_through(eng, attn, set())
    assert out == {k: v for k, v in reference().items() if k >= 10}
    assert_all_free(eng)


def test_failures_during_chunked_prefill():
    # prompts of 3-18 tokens through a 5-token prefill budget: steps alternate chunks and decodes
    eng, attn = failing(max_prefill_tokens=5)
    eng.add(requests())
    out, failed = step_through(eng, attn, {1, 2, 5, 9})
    assert out == reference(max_prefill_tokens=5) == reference()
    assert failed == 4
    assert_all_free(eng)


def test_an_interrupt_mid_step_leaves_the_engine_consistent():
    # Ctrl-C in an interactive session driving an engine: a BaseException, not an Exception
    eng, attn = failing()
    attn.error = KeyboardInterrupt()
    eng.add(requests())
    out, failed = step_through(eng, attn, {0})  # the first prefill
    assert out == reference() and failed == 1
    assert_all_free(eng)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_seeded_samples_are_unchanged_by_a_step_that_failed_after_its_draws(backend):
    # a Ctrl-C while a GPU step waits in its one device->host copy comes after the sampler drew:
    # re-run, a seeded request must draw the same uniform again, not the next one (review, s47)
    def reqs():
        return [Request(i, torch.arange(5 + i, 12 + i), 8, 8, sampling=SamplingParams(temperature=1.0, seed=100 + i))
                for i in range(3)] + [Request(9, torch.arange(3, 9), 8, 8, sampling=GREEDY)]

    clean = {s.sample_id: s.output_ids.tolist() for s in generate_all(engine(backend), reqs())}
    eng = engine(backend)
    draw = eng.runner.sampler.__class__.__call__
    fail_at = {0, 3, 4}  # the prefill, two decodes in a row

    class AfterDraw(eng.runner.sampler.__class__):
        calls = 0

        def __call__(self, logits, seqs):
            out = draw(self, logits, seqs)
            AfterDraw.calls += 1
            if AfterDraw.calls - 1 in fail_at:
                raise KeyboardInterrupt
            return out

    eng.runner.sampler.__class__ = AfterDraw
    eng.add(reqs())
    got, failed = {}, 0
    while eng.has_work():
        try:
            got.update({s.sample_id: s.output_ids.tolist() for s in eng.step()})
        except KeyboardInterrupt:
            failed += 1
    assert failed == 3 and got == clean
    assert_all_free(eng)
