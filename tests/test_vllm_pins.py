"""vLLM backend behaviour a one-line change left unnoticed (mutation review, session 57): the
prefix cache dropped after a weight load (blocks of the old weights served a repeated prompt),
non-greedy log-probs of the native sampler's policy (top-p dropped passed), CPU seeds 2**32 apart,
aborts and reloads taking requests out of vLLM itself, a closed in-process engine giving the
process back, a sample id already in flight refused. Skipped where vLLM is not installed.
Run before tests/test_vllm.py (.ci/run's order): its shared engine keeps the process's one
in-process engine core to the session's end, and these tests read stats() after one step()
of an in-process core (a spawned one schedules later)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/install_vllm.sh): vLLM tests skipped")

from test_vllm import _cfg, _model  # noqa: E402
from workers.generation.engine import NativeEngine  # noqa: E402
from workers.generation.generate_all import generate_all  # noqa: E402
from workers.generation.factory import make_engine  # noqa: E402
from workers.generation.sampler import Sampler  # noqa: E402
from workers.model import save_pretrained  # noqa: E402
from workers.types import Request, SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm
torch.set_num_threads(1)
V = 128


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_pins") / "model"
    model = _model(0)  # no EOS: every request runs to its length
    save_pretrained(model, d)
    e = make_engine(_cfg("vllm", admission="fcfs"), str(d))
    yield dict(eng=e, model=model, dir=str(d))
    e.close()


def test_sampled_logprobs_are_the_native_samplers_policy(eng):
    """Non-greedy: each log-prob vLLM returns is the native sampler's (T, top-k, top-p) log-prob of
    that token, recomputed from the model's logits over prompt + output."""
    e, model = eng["eng"], eng["model"]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, V, (n,), generator=g) for n in (5, 12)]
    sp = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, seed=3)
    got = generate_all(e, [Request(sample_id=700 + i, prompt_ids=p, max_tokens=10, min_tokens=10, sampling=sp)
                           for i, p in enumerate(prompts)])
    for p, s in zip(prompts, got):
        seq = torch.cat([p, s.output_ids])
        with torch.no_grad():
            logits = model.forward_packed([seq])[len(p) - 1:-1]  # the logits each output token was drawn from
        want = Sampler._filtered_logprobs(logits, [sp] * len(logits), [False] * len(logits))
        want = want.gather(1, s.output_ids[:, None])[:, 0]
        torch.testing.assert_close(s.logprobs, want, atol=1e-3, rtol=0)


def test_a_reload_drops_prefix_cache_blocks_of_the_old_weights(eng):
    """After load_weights a prompt vLLM cached under the old weights is computed again: the
    outputs equal a native engine's over the new weights."""
    e = eng["eng"]
    prompt = torch.arange(96) % (V - 2) + 2  # three full 32-token blocks, cached by the first run
    req = [Request(sample_id=800, prompt_ids=prompt, max_tokens=6, min_tokens=6,
                   sampling=SamplingParams(temperature=0.0))]
    generate_all(e, req)
    new = _model(7)
    try:
        e.load_weights(new.hf_state_dict().items(), version=e.weight_version + 1)
        got = generate_all(e, req)[0]
        want = generate_all(NativeEngine(_cfg("native"), model=new), req)[0]
        assert got.output_ids.tolist() == want.output_ids.tolist()
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-4, rtol=0)
    finally:
        e.load_weights(eng["model"].hf_state_dict().items(), version=e.weight_version + 1)


def test_seeds_2_pow_32_apart_draw_differently_on_cpu(eng):
    """torch's CPU generator keeps a seed's low 32 bits: the engine folds the high bits in (as the
    native sampler), so seeds 2**32 apart are different draws; the same seed draws alike."""
    e = eng["eng"]
    p = torch.tensor([3, 4, 5, 6])
    reqs = [Request(sample_id=900 + i, prompt_ids=p, max_tokens=12, min_tokens=12,
                    sampling=SamplingParams(temperature=1.0, seed=s)) for i, s in enumerate((5, 5, 5 + 2 ** 32))]
    a, b, c = (s.output_ids.tolist() for s in generate_all(e, reqs))
    assert a == b and a != c


def _long(first_id, n, new=48):
    g = torch.Generator().manual_seed(first_id)
    return [Request(sample_id=first_id + i, prompt_ids=torch.randint(2, V, (6,), generator=g), max_tokens=new,
                    min_tokens=new, sampling=SamplingParams(temperature=0.0)) for i in range(n)]


def _finished(e) -> list[int]:
    """The ids of the samples the engine finishes from here on."""
    got = []
    while e.has_work():
        got += e.step()
    return sorted(s.sample_id for s in got)


def test_aborted_requests_leave_vllm_and_free_their_slots(eng):
    """abort() takes running requests out of vLLM itself: after it vLLM runs the queued requests
    the freed slots admit, never more than max_batch_size (stats().running is vLLM's count)."""
    e = eng["eng"]
    e.set_max_batch_size(2)
    try:
        e.add(_long(1000, 4))
        e.step()
        assert e.stats().running == 2
        assert e.abort([1000, 1001]) == [1000, 1001]
        e.step()
        assert e.stats().running == 2 and e.stats().waiting == 0
        assert _finished(e) == [1002, 1003]
    finally:
        e.set_max_batch_size(4)


def test_a_reload_takes_the_old_requests_out_of_vllm(eng):
    """load_weights restarts the requests in flight from their prompts: the old ones leave vLLM
    (they would run on, unseen, beside their restarts), so it runs max_batch_size at most."""
    e = eng["eng"]
    e.set_max_batch_size(2)
    try:
        e.add(_long(1100, 2))
        e.step()
        e.load_weights(eng["model"].hf_state_dict().items(), version=e.weight_version + 1)
        e.step()
        assert e.stats().running == 2
        assert _finished(e) == [1100, 1101]
    finally:
        e.set_max_batch_size(4)


_REOPEN = """
import sys
from workers.generation.config import EngineConfig
from workers.generation.factory import make_engine

if __name__ == "__main__":
    cfg = EngineConfig(backend="vllm", max_batch_size=2, block_size=32, kv_cache_tokens=4096, device="cpu",
                       dtype="float32")
    first = make_engine(cfg, sys.argv[1])
    assert not first.subprocess
    first.close()
    second = make_engine(cfg, sys.argv[1])
    print("second in a child:", second.subprocess)
    second.close()
"""


def test_a_closed_in_process_engine_leaves_the_process_to_the_next(eng, tmp_path):
    """close() of an in-process engine core gives the process back: the next engine runs in
    process too, not in a spawned child. In a fresh process, as a rank is."""
    script = tmp_path / "reopen.py"
    script.write_text(_REOPEN)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    out = subprocess.run([sys.executable, str(script), eng["dir"]], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "second in a child: False" in out.stdout


def test_a_sample_id_already_in_flight_is_refused_and_the_first_kept(eng):
    """A second request with the id of one queued or running is refused at add(); the first
    runs to its end (vLLM's request id is made of the sample id: a duplicate would replace it)."""
    e = eng["eng"]
    first, again = _long(1200, 1, new=8)[0], _long(1300, 1, new=8)[0]
    again = Request(sample_id=1200, prompt_ids=again.prompt_ids, max_tokens=8, min_tokens=8,
                    sampling=SamplingParams(temperature=0.0))
    assert e.add([first]) == []
    [refused] = e.add([again])
    assert refused.finish_reason == "error" and "already queued or running" in refused.error
    got = []
    for _ in range(100):
        if not e.has_work():
            break
        got += e.step()
    assert [(s.sample_id, s.finish_reason, len(s.output_ids)) for s in got] == [(1200, "length", 8)]
    want = generate_all(NativeEngine(_cfg("native"), model=eng["model"]), [first])[0]
    assert got[0].output_ids.tolist() == want.output_ids.tolist()
