"""Automatic prefix caching (``EngineConfig.prefix_caching``, vLLM's ``enable_prefix_caching``):
full KV blocks are kept by a chained hash of their tokens and reused by any later request with
the same leading tokens. Greedy outputs equal full recomputation (and the engine with it off)
for a shared system prefix, a multi-turn continuation, preemption, chunked prefill, group
prefix sharing at the same time, new weights, abort and a failed step; the hits are the blocks
expected; under memory pressure the least recently freed cached blocks are evicted and never
found by hash again."""
import copy

import pytest
import torch
from test_engine import MODEL, check_against_recompute, engine, greedy_requests, prompts, recompute_greedy, tiny_model
from test_engine_step_failure import MODEL as FAIL_MODEL
from test_engine_step_failure import failing

from workers.generation.block_manager import BlockManager, block_hashes
from workers.generation.generate_all import generate_all
from workers.generation.sequence import Sequence
from workers.types import Request, SamplingParams

BS = 4
SYSTEM = prompts([22], seed=11)[0]  # 5 full blocks of 4 and 2 tokens


def with_system(tails):
    return [torch.cat([SYSTEM, t]) for t in tails]


def run(eng, reqs):
    return generate_all(eng, reqs)


def hits(eng) -> int:
    return eng.stats().prefix_cache_hit_tokens


def test_shared_system_prefix_is_computed_once():
    ps = with_system(prompts([3, 9, 1, 14], seed=12))
    reqs = greedy_requests(ps, 8)
    eng = engine()
    check_against_recompute(reqs[:1], run(eng, reqs[:1]))
    assert hits(eng) == 0
    out = run(eng, reqs[1:])
    check_against_recompute(reqs[1:], out)
    # each later request finds the system prompt's 5 full blocks (the 6th holds its own tokens)
    assert hits(eng) == 3 * 5 * BS
    off = engine(prefix_caching=False)
    assert [s.output_ids.tolist() for s in run(off, reqs[1:])] == [s.output_ids.tolist() for s in out]
    assert hits(off) == 0 and not off.bm._block_of
    assert eng.stats().kv_blocks_used == 0 and eng.stats().kv_blocks_free == eng.bm.num_blocks


def test_multi_turn_continuation_computes_only_its_new_tokens():
    p1 = prompts([13], seed=13)[0]
    eng = engine()
    first = run(eng, greedy_requests([p1], 10))[0]
    obs = prompts([5], seed=14)[0]
    p2 = torch.cat([p1, first.output_ids, obs])  # the next turn: conversation so far + observation
    reqs = [Request(sample_id=1, prompt_ids=p2, max_tokens=9, min_tokens=9, sampling=SamplingParams(temperature=0.0))]
    check_against_recompute(reqs, run(eng, reqs))
    written = len(p1) + len(first.output_ids) - 1  # the last sampled token's K/V is never written
    assert hits(eng) == written // BS * BS
    assert len(p2) - hits(eng) <= len(obs) + BS  # its new tokens plus at most one block


def test_equals_recompute_across_preemption():
    ps = with_system(prompts([3, 9, 1, 14, 6, 2], seed=15))
    reqs = greedy_requests(ps, 12)
    eng = engine(kv_cache_tokens=96)  # 24 blocks of 4: six 40-token sequences do not fit
    out = run(eng, reqs)
    assert eng.stats().preemptions > 0 and hits(eng) > 0
    check_against_recompute(reqs, out)
    assert eng.stats().kv_blocks_used == 0


def test_a_preempted_sequence_finds_its_own_blocks():
    # a recomputation after preemption starts on its blocks still cached (prompt and output)
    reqs = greedy_requests(prompts([17, 9], seed=16), 12)
    eng = engine(max_batch_size=2)
    eng.add(reqs)
    for _ in range(6):
        eng.step()
    seq = eng.scheduler.running[-1]
    cached = seq.num_cached
    eng.set_max_batch_size(1)  # preempts the last admitted
    eng.set_max_batch_size(2)
    out = sorted(eng.step() + run(eng, []), key=lambda s: s.sample_id)
    check_against_recompute(reqs, out)
    assert hits(eng) == cached // BS * BS


def test_with_chunked_prefill():
    ps = with_system(prompts([3, 9, 1, 14], seed=17))
    reqs = greedy_requests(ps, 8)
    for budget in (1, 5):
        eng = engine(max_prefill_tokens=budget, max_batch_size=4)
        out = run(eng, reqs)
        check_against_recompute(reqs, out)
        assert hits(eng) > 0  # the first prompt's system blocks, registered chunk by chunk


def test_with_group_prefix_sharing_at_the_same_time():
    tails = prompts([3, 9, 6], seed=18)
    ps = with_system(tails)
    group_of = [i // 3 for i in range(9)]
    reqs = greedy_requests([ps[g] for g in group_of], 8, group_of)
    for kv in (4096, 96):
        eng = engine(kv_cache_tokens=kv, max_batch_size=9)
        out = run(eng, reqs[:3]) + run(eng, reqs[3:])  # groups 1 and 2 find group 0's system blocks
        check_against_recompute(reqs, out)
        assert hits(eng) >= 2 * 5 * BS and not eng.prefix.groups and eng.stats().kv_blocks_used == 0
        if kv == 96:
            assert eng.stats().preemptions > 0


def test_new_weights_leave_no_stale_hit():
    reqs = greedy_requests(with_system(prompts([3, 9], seed=19)), 8)
    new = tiny_model(seed=7)
    eng = engine(model=tiny_model())  # own copy: load_weights writes into it
    run(eng, reqs)
    assert eng.bm._block_of
    eng.load_weights(new.hf_state_dict().items(), version=1)
    assert not eng.bm._block_of and eng.stats().kv_blocks_free == eng.bm.num_blocks
    before = hits(eng)
    out = run(eng, reqs[:1])
    assert hits(eng) == before  # nothing of the old weights is found
    check_against_recompute(reqs[:1], out, model=new)
    out = run(eng, reqs[1:])  # the new weights' blocks are found again
    assert hits(eng) == before + 5 * BS
    check_against_recompute(reqs[1:], out, model=new)


def test_new_weights_mid_flight():
    reqs = greedy_requests(with_system(prompts([3, 9, 5], seed=20)), 10)
    new = tiny_model(seed=8)
    eng = engine(model=tiny_model(), max_batch_size=2)
    eng.add(reqs)
    for _ in range(5):
        eng.step()
    eng.load_weights(new.hf_state_dict().items(), version=1)
    out = sorted(run(eng, []), key=lambda s: s.sample_id)
    check_against_recompute(reqs, out, model=new)


def test_abort_part_way_through_a_prefill():
    # an aborted prefill leaves hashes only for the blocks its completed chunks wrote
    p = with_system(prompts([9], seed=21))
    eng = engine(max_prefill_tokens=8)
    eng.add(greedy_requests(p, 6))
    eng.step()  # tokens [0, 8): two full blocks
    assert len(eng.bm._block_of) == 2
    assert eng.abort([0]) == [0]
    assert len(eng.bm._block_of) == 2 and eng.stats().kv_blocks_used == 0
    reqs = [Request(sample_id=5, prompt_ids=p[0], max_tokens=6, min_tokens=6, sampling=SamplingParams(temperature=0.0))]
    check_against_recompute(reqs, run(eng, reqs))
    assert hits(eng) == 8


def test_a_failed_step_registers_nothing_it_wrote():
    p = prompts([30], seed=22)[0] % 89
    reqs = [Request(sample_id=0, prompt_ids=p, max_tokens=7, min_tokens=7, sampling=SamplingParams(temperature=0.0))]
    eng, attn = failing(max_prefill_tokens=8)
    eng.add(reqs)
    eng.step()  # blocks 0, 1 written and registered
    attn.armed = True
    try:
        eng.step()  # tokens [8, 16) half written (layer 0 only): blocks 2, 3 must not be registered
    except RuntimeError:
        pass
    else:
        raise AssertionError("the injected failure did not fire")
    assert len(eng.bm._block_of) == 2
    out = run(eng, [])
    assert hits(eng) == 8  # the requeued sequence starts on its two registered blocks
    want = recompute_greedy(FAIL_MODEL, p, 7)[0]
    assert out[0].output_ids.tolist() == want
    again = run(eng, [Request(sample_id=1, prompt_ids=p, max_tokens=7, min_tokens=7,
                              sampling=SamplingParams(temperature=0.0))])
    assert again[0].output_ids.tolist() == want and hits(eng) == 8 + 28


def test_eviction_under_memory_pressure_is_lru_and_forgets_the_hash():
    a, b, c = prompts([21, 21, 21], seed=23)
    eng = engine(kv_cache_tokens=64)  # 16 blocks of 4
    ra, rb, rc = (greedy_requests([p], n)[0] for p, n in ((a, 8), (b, 20), (c, 8)))
    run(eng, [ra])  # 7 full blocks cached, 9 plain free
    seq_a = Sequence.from_request(ra, 0)
    first_a = block_hashes(seq_a, 1, BS)[0]
    block = eng.bm._block_of[first_a]
    assert eng.stats().kv_blocks_used == 0  # cached blocks count as free
    run(eng, [rb])  # b's 10 blocks (40 tokens written): the 9 plain ones, then a's least recently freed, its first
    assert first_a not in eng.bm._block_of and eng.bm._hash_of.get(block) != first_a  # b's now
    before = hits(eng)
    out = run(eng, [Request(sample_id=9, prompt_ids=a, max_tokens=8, min_tokens=8,
                            sampling=SamplingParams(temperature=0.0))])
    assert hits(eng) == before  # a's first block is gone, so none of its chain is found
    assert out[0].output_ids.tolist() == recompute_greedy(MODEL, a, 8)[0]
    run(eng, [rc])
    assert eng.stats().kv_blocks_used == 0


def test_block_manager_takes_plain_blocks_first_then_the_least_recently_freed():
    bm = BlockManager(4, 2, caching=True)
    s1 = Sequence.from_request(Request(0, torch.tensor([1, 2, 3, 4, 5]), 1), 0)
    s2 = Sequence.from_request(Request(1, torch.tensor([6, 7, 8]), 1), 1)
    bm.prepare_write(s1, 5)  # 3 blocks
    s1.num_cached = 4
    bm.register(s1)  # its two full blocks
    first, second = s1.block_table[:2]
    bm.free(s1)
    assert bm.num_free == 4 and bm.num_used == 0 and list(bm._evictable) == [first, second]
    bm.prepare_write(s2, 3)  # 2 blocks: the 2 plain ones, then... none evicted
    assert len(bm._evictable) == 2
    s3 = Sequence.from_request(Request(2, torch.tensor([1, 2, 9, 9, 9]), 1), 2)
    assert bm.match(s3) == 2 and s3.block_table == [first]  # shared: no longer evictable
    assert list(bm._evictable) == [second] and bm.num_free == 1
    s4 = Sequence.from_request(Request(3, torch.tensor([5]), 1), 3)
    bm.prepare_write(s4, 1)  # evicts `second`
    assert s4.block_table == [second] and len(bm._block_of) == 1
    bm.free(s3)
    assert list(bm._evictable) == [first]


def test_config_key_and_the_vllm_mapping():
    import pytest

    from workers.generation import vllm_args
    from workers.generation.config import EngineConfig
    from workers.model import ModelConfig

    with pytest.raises(ValueError, match="engine.prefix_caching: expected bool, got str 'false'"):
        EngineConfig(prefix_caching="false")
    mc = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    for sharing, caching in ((False, False), (True, False), (False, True), (True, True)):
        cfg = EngineConfig(backend="vllm", device="cpu", prefix_sharing=sharing, prefix_caching=caching)
        assert vllm_args.engine_args(cfg, "/m", mc)["enable_prefix_caching"] is (sharing or caching)
    assert not engine(prefix_caching=False).bm.caching and engine().bm.caching  # on by default


def test_weights_written_in_place_drop_the_cached_blocks():
    """A colocated engine shares its trainer's model: an optimizer step writes the weights in place,
    not through load_weights. The next request must not find K/V of the old values by hash: its
    output equals a fresh engine's on the new weights."""
    model = tiny_model(seed=3)
    eng = engine(model)
    prompt = torch.arange(3, 24)
    req = lambda sid: Request(sid, prompt, 6, sampling=SamplingParams(temperature=0.0))  # noqa: E731
    generate_all(eng, [req(0)])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    [again] = generate_all(eng, [req(1)])
    [ref] = generate_all(engine(copy.deepcopy(model), prefix_caching=False), [req(2)])
    assert again.output_ids.tolist() == ref.output_ids.tolist()
    assert eng.stats().prefix_cache_hit_tokens == 0  # the only earlier blocks were of the old weights


@pytest.mark.parametrize("which", ["embed", "o_proj", "down_proj", "norms"])
def test_an_in_place_write_of_weights_the_fused_forward_does_not_copy_drops_the_cached_blocks(which):
    """Only the parameters the fused forward copies were watched: an in-place write of the
    embedding, or of o_proj / down_proj / the norms on the plain-GEMM path, left the cached K/V of
    the old values in use (review, s54)."""
    model = tiny_model(seed=3)
    eng = engine(model, cpu_prepack=False, attention_backend="torch")
    prompt = torch.arange(3, 24)
    req = lambda sid: Request(sid, prompt, 6, min_tokens=6, sampling=SamplingParams(temperature=0.0))  # noqa: E731
    generate_all(eng, [req(0)])
    layers = model.model.layers
    with torch.no_grad():
        for p in {"embed": [model.model.embed_tokens.weight], "o_proj": [l.self_attn.o_proj.weight for l in layers],
                  "down_proj": [l.mlp.down_proj.weight for l in layers],
                  "norms": [l.input_layernorm.weight for l in layers]}[which]:
            p.mul_(-1.5)
        if which == "embed":  # and a new Parameter object in its slot, as load_state_dict(assign=True)
            model.model.embed_tokens.weight = torch.nn.Parameter(model.model.embed_tokens.weight * 0.5)
    [again] = generate_all(eng, [req(1)])
    assert again.output_ids.tolist() == _fresh(model, req(2)).output_ids.tolist()
    assert eng.stats().prefix_cache_hit_tokens == 0


def _scale_in_place(model):
    with torch.no_grad():  # a colocated trainer's optimizer step on the engine's model
        for p in model.parameters():
            p.mul_(1.3)


def _fresh(model, req):
    return generate_all(engine(copy.deepcopy(model), prefix_caching=False, prefix_sharing=False), [req])[0]


@pytest.mark.parametrize("caching", [True, False])
def test_weights_written_in_place_drop_the_group_prompt_pins(caching):
    """A group sibling still waiting when the weights change in place must not start on its
    group's pinned prompt (K/V of the old values), nor, with caching, file those blocks under
    their hashes again for later requests to find (review, session 47)."""
    model = tiny_model(seed=3)
    eng = engine(model, max_batch_size=1, prefix_caching=caching)
    prompt = torch.arange(3, 24)
    req = lambda sid, group=-1: Request(sid, prompt, 6, 6, sampling=SamplingParams(temperature=0.0),  # noqa: E731
                                        group_id=group)
    eng.add([req(0, 7), req(1, 7)])
    done = []
    while not done:
        done += eng.step()  # sample 0 computed (and pinned) the group's prompt; sample 1 waits
    assert [s.sample_id for s in done] == [0] and eng.prefix.groups
    _scale_in_place(model)
    [sibling] = generate_all(eng, [])
    [later] = generate_all(eng, [req(2)])
    want = _fresh(model, req(2)).output_ids.tolist()
    assert sibling.output_ids.tolist() == want and later.output_ids.tolist() == want


def test_a_sequence_running_across_an_in_place_change_registers_no_more_blocks():
    """Its blocks filled after the change hold K/V computed over its old-weight prefix: filed by
    hash, a later request that found fresh leading blocks would go on into them."""
    model = tiny_model(seed=3)
    eng = engine(model, prefix_sharing=False)
    greedy = SamplingParams(temperature=0.0)
    p = torch.arange(3, 11)  # 2 full blocks
    eng.add([Request(0, p, 14, 14, sampling=greedy)])
    eng.step(), eng.step()  # its prefill (2 blocks hashed) and a decode
    _scale_in_place(model)
    eng.add([Request(1, torch.tensor([90, 91]), 1, 1, sampling=greedy)])  # waiting: the next step checks
    out = run(eng, [])
    prompt = torch.cat([p, next(s for s in out if s.sample_id == 0).output_ids])[:21]
    generate_all(eng, [Request(2, prompt, 4, 4, sampling=greedy)])  # fresh K/V for the leading blocks
    [d] = generate_all(eng, [Request(3, prompt, 4, 4, sampling=greedy)])
    ref = _fresh(model, Request(3, prompt, 4, 4, sampling=greedy))
    assert d.output_ids.tolist() == ref.output_ids.tolist()
    torch.testing.assert_close(d.logprobs, ref.logprobs, rtol=1e-4, atol=1e-4)


def test_block_hashes_are_chained_sha256_of_the_token_ids():
    import hashlib
    import struct
    toks = [7, 300, 7, 300, 7, 300, 7, 300, 5]  # blocks 0 and 1 hold the same tokens
    seq = Sequence.from_request(Request(sample_id=0, prompt_ids=torch.tensor(toks), max_tokens=1), 0)
    hs = block_hashes(seq, 2, BS)
    h0 = hashlib.sha256(struct.pack("<4q", *toks[:4])).digest()
    assert hs == [h0, hashlib.sha256(h0 + struct.pack("<4q", *toks[4:8])).digest()]
    assert hs[0] != hs[1]  # the same tokens at another position are another block
    assert block_hashes(seq, 2, BS) is seq.block_hashes and len(seq.block_hashes) == 2  # kept, not recomputed
