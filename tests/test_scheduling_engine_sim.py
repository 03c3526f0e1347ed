"""The instance model (controller/planner/engine_sim.py) against the real native engine:
same requests, same admission order, same KV budget and batch cap -> the same counts of decode
steps, prefill steps, prefill tokens and preemptions (counted, not timed) when the KV cache
never runs out, and close ones under KV pressure (measured: decode steps within 3%, prefill
steps within 25%, preemptions within 33%; the model does not copy the engine's admission
watermark and preemption victim choice); and the dispatcher's choices of batch cap and
admission order are its own cost model's argmin."""
import numpy as np
import pytest
import torch

from controller.planner.engine_sim import simulate_instance
from controller.dispatch_cost import no_preemption_cap, simulated_cost
from controller.scheduling import PTLProfile, make_dispatcher
from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.model import CausalLM, ModelConfig, init_weights
from workers.types import Request, SamplingParams

MC = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=1024)


def run_engine(out_lens, prompt_lens, kv_tokens, cap):
    """Length-forced requests through the native engine; counts of its steps by kind."""
    torch.set_num_threads(1)
    cfg = EngineConfig(max_batch_size=cap, block_size=16, kv_cache_tokens=kv_tokens, max_prefill_tokens=4096,
                       device="cpu", dtype="float32", prefix_sharing=False, seed=0)
    eng = NativeEngine(cfg, model=init_weights(CausalLM(MC), seed=0))
    g = torch.Generator().manual_seed(0)
    eng.add([Request(sample_id=i, prompt_ids=torch.randint(3, 64, (p,), generator=g), max_tokens=n, min_tokens=n,
                     sampling=SamplingParams(temperature=1.0, seed=i)) for i, (n, p) in enumerate(zip(out_lens, prompt_lens))])
    counts = {"decode": 0, "prefill": 0, "prefill_tokens": 0}
    schedule = eng.scheduler.schedule

    def counting_schedule():  # a spy: the engine's own schedule(), each batch counted by kind
        batch = schedule()
        if batch is not None:
            counts["prefill" if batch.is_prefill else "decode"] += 1
            if batch.is_prefill:
                counts["prefill_tokens"] += sum(s.num_tokens - s.num_cached for s in batch.seqs)
        return batch

    eng.scheduler.schedule = counting_schedule
    while eng.has_work():
        eng.step()
    counts["preemptions"] = eng.scheduler.preemptions
    return counts, eng.cfg.total_blocks * eng.cfg.block_size


@pytest.mark.parametrize("kv_tokens,n,cap", [(512, 40, 64), (512, 40, 12), (1024, 60, 64), (2048, 40, 6)])
def test_instance_model_counts_match_the_engine(kv_tokens, n, cap):
    rng = np.random.default_rng(kv_tokens + n + cap)
    out = [int(min(200, max(1, x))) for x in np.exp(rng.normal(3.3, 0.9, n))]
    prompts = [int(x) for x in rng.integers(4, 20, n)]
    eng, kv = run_engine(out, prompts, kv_tokens, cap)
    # prefill_step_s > 0: a measured prefill step, which yields each admitted sequence's next token
    prof = PTLProfile([1], [1.0], kv_tokens=kv, block_size=16, prefill_step_s=1.0)
    sim = simulate_instance(out, prof, cap, prompts)
    assert sim.decode_steps == pytest.approx(eng["decode"], rel=0.05)
    assert sim.prefill_steps == pytest.approx(eng["prefill"], rel=0.35, abs=3)
    assert sim.prefill_tokens == pytest.approx(eng["prefill_tokens"], rel=0.2)
    if eng["preemptions"] == 0:  # no KV pressure: the model is the engine's step sequence
        assert (sim.decode_steps, sim.prefill_steps, sim.prefill_tokens, sim.preemptions) == \
            (eng["decode"], eng["prefill"], eng["prefill_tokens"], 0)
    else:
        assert sim.preemptions == pytest.approx(eng["preemptions"], rel=0.4)


def test_measured_prefill_yields_the_first_token():
    free = PTLProfile([1], [1.0], kv_tokens=10**4, block_size=16)
    measured = PTLProfile([1], [1.0], kv_tokens=10**4, block_size=16, prefill_step_s=0.5)
    assert simulate_instance([10], free, 1, [4]).makespan_s == pytest.approx(10.0)  # the paper's PTL * L
    run = simulate_instance([10], measured, 1, [4])
    assert (run.decode_steps, run.prefill_steps, run.makespan_s) == (9, 1, pytest.approx(9.5))
    assert simulate_instance([1], measured, 1, [4]).makespan_s == pytest.approx(0.5)  # done in its prefill


@pytest.mark.parametrize("alloc", ["lazy", "reserve"])
def test_a_slot_freed_in_the_prefill_is_refilled_before_decoding(alloc):
    # the engine's scheduler admits whenever it can: a 1-token request finishes in its
    # prefill step and the next request takes its slot before the next decode step
    prof = PTLProfile([1, 4, 16], [1.0, 1.3, 2.5], kv_tokens=10**7, block_size=16, prefill_step_s=0.7)
    run = simulate_instance([3, 1, 1], prof, 2, [0, 0, 0], alloc=alloc)
    # prefill {0, 1} (1 done) 0.7, prefill {2} (2 done) 1.4, two decode steps of 0 alone
    assert run.finish_s == pytest.approx([3.4, 0.7, 1.4])
    run = simulate_instance([5, 1, 5], prof, 2, [0, 0, 0], alloc=alloc)
    assert run.makespan_s == pytest.approx(0.7 + 0.7 + 4 * prof.ptl(2))


def test_simulated_cost_picks_the_cap_its_model_says_is_faster():
    lens = [120.0] * 24
    # recomputation is expensive: preempting costs more than a smaller batch
    slow_prefill = PTLProfile([1, 64], [1.0, 1.2], kv_tokens=1024, block_size=16, prefill_step_s=1.0,
                              prefill_s_per_token=1.0)
    t, cap = simulated_cost(slow_prefill, lens, 0.0, 8.0)
    safe = no_preemption_cap(slow_prefill, lens, 8.0)
    assert cap == safe == 1024 // (128 + 16)
    runs = {c: simulate_instance([120] * 24, slow_prefill, c, [8] * 24) for c in (24, safe)}
    assert runs[24].preemptions > 0 and runs[safe].preemptions == 0
    assert t == pytest.approx(runs[safe].makespan_s)
    assert t < runs[24].makespan_s
    # free recomputation and a flat PTL: the bigger batch wins, it keeps the memory-only cap
    cheap = PTLProfile([1], [1.0], kv_tokens=1024, block_size=16)
    assert simulated_cost(cheap, lens, 0.0, 8.0)[1] == 24


def test_skew_orders_are_its_cost_models_choice_per_instance():
    rng = np.random.default_rng(2)
    est = [float(x) for x in np.exp(rng.normal(4.0, 1.0, size=90))]
    profs = [PTLProfile([1, 64], [1.0, 2.0], kv_tokens=2048, block_size=16, prefill_step_s=0.5)] * 3
    d = make_dispatcher("skew", orders=("fcfs",), mixed_order=None)
    plan = d.plan(est, profs)
    for g, cap, t in zip(plan.per_instance, plan.batch_caps, plan.predicted_s):
        options = {o: simulated_cost(profs[0], [est[i] for i in order], 0.0, 0.0)
                   for o, order in (("lpt", sorted(g, key=lambda i: (-est[i], i))), ("fcfs", sorted(g)))}
        best = min(options, key=lambda o: options[o][0])
        assert g == (sorted(g) if best == "fcfs" else sorted(g, key=lambda i: (-est[i], i)))
        assert (t, cap) == (pytest.approx(options[best][0]), options[best][1])
    with pytest.raises(ValueError, match="order 'sideways' is not one of"):
        make_dispatcher("skew", orders=("sideways",))
