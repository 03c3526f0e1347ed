"""Sync pipeline modes produce the same update as ``batch`` on the same samples.

The trainer rank's release policies (all / minibatch / stream) only change *when* samples
reach ``TrainerWorker.receive``; losses are sums divided at ``step()``, so the weights after
one step must match. In-process (no RPC): the same TrainerRank class the runtime uses."""
import threading

import pytest
import torch
from runtime_helpers import TASK, tiny_model  # noqa: F401

from controller.trainer_rank import TrainerRank
from workers.generation.config import EngineConfig
from workers.generation.factory import make_engine
from workers.tasks.registry import make_task
from workers.trainer.config import TrainerConfig
from workers.types import Request, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model):  # noqa: F811 - the runtime tests' session-wide tiny model
    return tiny_model


@pytest.fixture(scope="module")
def samples(model_dir):
    from workers.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    items = make_task("synthetic", **TASK).prompts("train")[:6]
    eng = make_engine(EngineConfig(device="cpu", kv_cache_tokens=4096), model_dir, [tok.eos_id])
    reqs = [Request(j * 3 + k, torch.tensor(tok.encode(tok.format_prompt(it.prompt))), 12, group_id=j,
                    sampling=SamplingParams(temperature=1.0, seed=j * 3 + k))
            for j, it in enumerate(items) for k in range(3)]
    eng.add(reqs)
    out = []
    while eng.has_work():
        out += eng.step()
    for s in out:  # one correct answer per group, so GRPO advantages are not all zero
        if s.sample_id % 3 == 0:
            s.output_ids = torch.tensor(tok.encode(items[s.group_id].answer) + [tok.eos_id])
            s.logprobs = torch.full((len(s.output_ids),), -2.0)
    out.sort(key=lambda s: -len(s.output_ids))  # arrival order differs from group order
    prompts = {r.sample_id: items[r.group_id] for r in reqs}
    return out, prompts


def _train(model_dir, samples, prompts, mode):
    tcfg = TrainerConfig(algorithm="grpo", lr=1e-2, max_tokens_per_microbatch=64, seed=0)
    rank = TrainerRank(1, [1], tcfg, model_dir, "synthetic", TASK)
    rank.begin_iteration(0, prompts, {g: 3 for g in range(6)}, mode, 4)
    feeder = threading.Thread(target=lambda: [rank.receive([s]) for s in samples])
    feeder.start()
    feeder.join()
    rep = rank.step(0)
    rank.close()
    return rep, {k: v.detach().clone() for k, v in rank.worker.named_weights()}


def test_sync_modes_match_batch(model_dir, samples):
    out, prompts = samples
    rep_b, w_b = _train(model_dir, out, prompts, "batch")
    assert rep_b.version == 1 and rep_b.num_samples == len(out) and rep_b.staleness_max == 0
    for mode in ("minibatch", "stream"):
        rep, w = _train(model_dir, out, prompts, mode)
        assert rep.num_samples == rep_b.num_samples and rep.num_tokens == rep_b.num_tokens
        for k in w_b:
            torch.testing.assert_close(w[k], w_b[k], rtol=1e-4, atol=1e-5, msg=f"{mode}: {k}")
        assert any(not torch.equal(w_b[k], v) for k, v in _initial(model_dir).items())


def _initial(model_dir):
    from workers.model import load_pretrained

    return load_pretrained(model_dir, "cpu", torch.float32).hf_state_dict()


def test_duplicates_dropped_and_staleness_checked(model_dir, samples):
    out, prompts = samples
    tcfg = TrainerConfig(algorithm="grpo", lr=1e-2, max_tokens_per_microbatch=64)
    rank = TrainerRank(1, [1], tcfg, model_dir, "synthetic", TASK)
    rank.begin_iteration(0, prompts, {g: 3 for g in range(6)}, "stream", 4)
    from dataclasses import replace

    first = [replace(s, instance=3) for s in out[:5]]  # streamed by rank 3 before it was lost
    assert rank.receive(first) == 5
    again = [replace(s, instance=1, output_ids=s.output_ids[:1], logprobs=s.logprobs[:1]) for s in out[:5]]
    assert rank.receive(again) == 0  # re-dispatched duplicates are never trained twice
    rank.receive([replace(s, instance=1) for s in out[5:]])
    rep = rank.step(0)
    assert rep.duplicates == 5 and rep.num_samples == len(out)
    # what was trained, each sample once as it first arrived, and who gave it
    assert rep.lengths == {s.sample_id: len(s.output_ids) for s in out}
    assert rep.per_instance == {3: 5, 1: len(out) - 5}
    # a sample claiming a future weight version violates staleness >= 0
    rank.begin_iteration(1, {10**6: prompts[0]}, {10**6: 1}, "stream", 4)
    bad = out[0]
    bad = type(bad)(**{**vars(bad), "sample_id": 10**6, "group_id": 10**6, "weight_version": 5})
    rank.receive([bad])
    with pytest.raises(RuntimeError, match="staleness"):
        rank.step(1)
    rank.close()


def test_an_iteration_with_no_group_for_this_rank_steps_at_once(model_dir):
    """A data-parallel rank may be given no prompt group (group ids go to ranks by id mod the
    number of ranks): its step() must still run (and all-reduce zeros), not wait for samples
    that never come (it hung: RL correctness audit, session 18)."""
    rank = TrainerRank(1, [1], TrainerConfig(algorithm="grpo", seed=0), model_dir, "synthetic", TASK)
    before = {k: v.detach().clone() for k, v in rank.worker.named_weights()}
    rank.begin_iteration(0, {}, {}, "stream", 4)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("report", rank.step(0)), daemon=True)
    t.start()
    t.join(60)
    rank.close()
    assert not t.is_alive(), "step() of an empty iteration did not return"
    rep = done["report"]
    assert rep.iteration == 0 and rep.num_samples == 0 and rep.num_tokens == 0
    after = dict(rank.worker.named_weights())
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing to learn from


def test_async_staleness_bound_is_inclusive_and_enforced(model_dir, samples):
    """An async mode (max_staleness 1) trains a sample one weight version behind the trainer,
    and refuses one ``max_staleness + 1`` behind (an upper bound, not only staleness >= 0)."""
    out, prompts = samples
    tcfg = TrainerConfig(algorithm="grpo", lr=1e-2, max_tokens_per_microbatch=64)
    rank = TrainerRank(1, [1], tcfg, model_dir, "synthetic", TASK)
    rank.begin_iteration(0, prompts, {g: 3 for g in range(6)}, "stream", 4)
    rank.receive(out)
    assert rank.step(0).version == 1

    def one(iteration, sid, weight_version):
        rank.begin_iteration(iteration, {sid: prompts[out[0].sample_id]}, {sid: 1}, "async_stream", 4)
        s = type(out[0])(**{**vars(out[0]), "sample_id": sid, "group_id": sid, "weight_version": weight_version})
        rank.receive([s])

    one(1, 10**6, 0)  # staleness 1 == max_staleness: trained
    rep = rank.step(1)
    assert rep.version == 2 and rep.num_samples == 1 and rep.staleness_max == 1
    one(2, 10**6 + 1, 0)  # staleness 2 == max_staleness + 1
    with pytest.raises(RuntimeError, match=r"staleness 2 outside \[0, 1\]"):
        rank.step(2)
    rank.close()
