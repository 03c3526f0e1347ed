"""Engine behaviour the rest of the suite let through when changed by one line (mutation
review, session 56): a lone request that needs every block but one is admitted, a block-aligned
prompt served whole from the prefix cache still computes its last token, a preempted sequence
registers its blocks again, memory pressure keeps a running group's pin, a continuing chunked
prefill leaves its batch slot to a waiting request, the torch draw at u = 0 never returns a
token without mass, an abort drops a sample an interrupted step finished, a sequence restarted by
new weights registers no block under its discarded output's hashes."""
import copy
import signal
from types import SimpleNamespace

import torch

from test_engine import GREEDY, V, check_against_recompute, engine, greedy_requests, prompts, tiny_model
from workers.generation.block_manager import NEVER_REGISTER, BlockManager
from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.generation.prefix_cache import PrefixCache
from workers.generation.sampler import Sampler
from workers.generation.scheduler import Scheduler
from workers.generation.sequence import Sequence
from workers.model import CausalLM, init_weights
from workers.model_config import ModelConfig
from workers.types import Request, SamplingParams


def _seq(i, tokens, group=-1, max_tokens=4):
    return Sequence.from_request(Request(sample_id=i, prompt_ids=torch.as_tensor(tokens), max_tokens=max_tokens,
                                         group_id=group, sampling=SamplingParams(temperature=0.0)), arrival=i)


def test_a_lone_request_that_needs_every_block_but_one_is_admitted():
    """200 blocks of 2 (watermark 2): a 397-token prompt and its output token take 199 blocks,
    which ``kv_len`` promises fit. The watermark is kept free only while others run; kept
    always, the request waited forever with nothing running and no error."""
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=512)
    eng = NativeEngine(EngineConfig(block_size=2, num_blocks=200, max_batch_size=8, prefix_sharing=False),
                       model=init_weights(CausalLM(cfg), seed=0, std=0.2).eval())
    assert eng.cfg.kv_len == 398
    eng.add(greedy_requests(prompts([397], seed=1), 1))
    done = []
    for _ in range(20):  # a prefill step or a few (chunks of max_prefill_tokens), then the token
        done += eng.step()
        if done:
            break
    assert [len(s.output_ids) for s in done] == [1]


def test_a_block_aligned_prompt_served_whole_from_the_cache_computes_its_last_token():
    """8 tokens are 2 full blocks of 4: the second request matches both, and the cache must
    still leave the last token to compute (its logits give the first output token)."""
    p = prompts([8], seed=3)[0]
    eng = engine()
    first = generate_all(eng, greedy_requests([p], 5))
    second = generate_all(eng, greedy_requests([p], 5))
    assert eng.stats().prefix_cache_hit_tokens >= 4
    assert second[0].output_ids.tolist() == first[0].output_ids.tolist()
    check_against_recompute(greedy_requests([p], 5), second)


def test_a_preempted_sequence_registers_its_blocks_again_once_recomputed():
    """A sequence whose K/V went stale under weights loaded in place never registers them
    (``NEVER_REGISTER``); preempted and recomputed under the new weights, it registers again,
    so a later request with the same prefix hits the cache."""
    bm = BlockManager(32, 4, caching=True)
    a = _seq(0, list(range(13)))
    bm.prepare_write(a, a.num_tokens)
    a.num_cached, a.num_hashed = 12, NEVER_REGISTER
    bm.free(a)  # preempted
    bm.match(a)
    bm.prepare_write(a, a.num_tokens)
    a.num_cached = 12
    bm.register(a)  # recomputed
    assert bm.match(_seq(1, list(range(13)))) == 12


def test_memory_pressure_keeps_the_pin_of_a_running_group():
    """Evicting the pin of a group with a running sample frees nothing (the sample holds the
    blocks) and made the siblings waiting to be admitted recompute the shared prompt."""
    bm = BlockManager(32, 4)
    cache = PrefixCache(bm)
    s = _seq(2, list(range(9)), group=5)
    bm.prepare_write(s, s.num_tokens)
    cache.pin(s)
    free = bm.num_free
    assert cache.evict_idle({5}) is False
    assert list(cache.groups) == [5] and bm.num_free == free


def test_a_continuing_chunked_prefill_leaves_its_batch_slot_to_a_waiting_request():
    """max_batch_size 2, a prefill budget of 8: a 10-token prompt takes two chunks; in its second
    (2 tokens) the 2-token prompt waiting is admitted beside it (counted twice, it was not)."""
    sch = Scheduler(BlockManager(64, 4), None, max_batch_size=2, max_prefill_tokens=8, chunked_prefill=True)
    a, b = _seq(0, torch.arange(10)), _seq(1, torch.arange(2))
    sch.add(a)
    sch.add(b)
    steps = []
    for _ in range(2):
        batch = sch.schedule()
        steps.append(([s.request.sample_id for s in batch.seqs], list(batch.ends)))
        for s, end in zip(batch.seqs, batch.ends):
            s.num_cached = end  # what the engine does after the forward
    assert steps == [([0], [8]), ([0, 1], [10, 2])]


def test_the_torch_draw_at_u_zero_never_returns_a_token_without_mass():
    """top_k 1 leaves token 3 alone with mass; a uniform of exactly 0 must draw it (the fused
    CPU path has this test; CUDA and top-k / top-p requests take this one)."""
    sampler = Sampler((), torch.device("cpu"))
    seq = SimpleNamespace(request=SimpleNamespace(sampling=SamplingParams(temperature=1.0, top_k=1), min_tokens=0),
                          num_output=0, generator=None)
    sampler._uniforms = lambda seqs, greedy, shared: torch.zeros(len(seqs), 1, dtype=torch.float64)
    ids, logprobs = sampler(torch.tensor([[0.0, 1.0, 2.0, 5.0]]), [seq])
    assert ids.tolist() == [3] and logprobs.tolist() == [0.0]


def test_abort_drops_a_sample_finished_by_an_interrupted_step():
    """A real SIGINT after the step's bookkeeping (as tests/test_engine_held_interrupt.py): the
    step that finished sample 0 raised KeyboardInterrupt, so sample 0 waits in the engine; an
    abort of it then must keep it from coming out."""
    eng = engine(tiny_model(3))
    eng.add([Request(i, torch.tensor([1 + i, 2, 3, 4, 5]), 2 + 3 * i, sampling=GREEDY) for i in range(2)])
    orig, calls = eng._count_tokens, []

    def ctrl_c(*a):
        calls.append(1)
        out = orig(*a)
        if len(calls) == 2:  # the step where sample 0 reaches its max_tokens 2
            signal.raise_signal(signal.SIGINT)
        return out
    eng._count_tokens = ctrl_c
    out, interrupted = [], False
    while eng.has_work() and not interrupted:
        try:
            out += eng.step()
        except KeyboardInterrupt:
            interrupted = True
    assert interrupted and out == []
    assert eng.abort([0]) == [0]
    while eng.has_work():
        out += eng.step()
    assert [s.sample_id for s in out] == [1]


def test_a_restarted_sequence_registers_no_block_under_its_old_outputs_hash():
    """Prefix caching across load_weights: sample 0 is restarted from its prompt; a later request
    whose prompt is that prompt + sample 0's discarded output must not reuse a block that holds
    K/V of different tokens."""
    old, new = tiny_model(3), tiny_model(4)
    prompt = torch.tensor([1, 2, 3, 4])
    [discarded] = generate_all(engine(copy.deepcopy(old)), [Request(0, prompt, 12, sampling=GREEDY)])
    eng = engine(copy.deepcopy(old))
    eng.add([Request(0, prompt, 12, sampling=GREEDY)])
    for _ in range(8):  # output blocks filled and hashed under the old weights
        assert eng.step() == []
    eng.load_weights(new.state_dict(), 1)
    while eng.has_work():
        eng.step()
    probe = Request(1, torch.cat([prompt, discarded.output_ids[:8]]), 4, sampling=GREEDY)
    [got] = generate_all(eng, [probe])
    [want] = generate_all(engine(copy.deepcopy(new), prefix_caching=False), [probe])
    assert got.output_ids.tolist() == want.output_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
