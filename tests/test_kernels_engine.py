"""The native engine with attention_backend="triton" (decode through kernels.paged_decode)
produces the same greedy tokens and log-probs as with attention_backend="torch".

On CPU the kernel runs in triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported; kernels/ imports triton lazily). On CUDA (bench/gpu_check.sh) it runs compiled.
"""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
pytest.importorskip("triton", reason="triton not installed (pip install streamrl[kernels])")

import kernels  # noqa: E402
import kernels.paged_decode  # noqa: E402
from workers.generation.config import EngineConfig  # noqa: E402
from workers.generation.engine import NativeEngine  # noqa: E402
from workers.generation.generate_all import generate_all  # noqa: E402
from workers.model import CausalLM, ModelConfig, init_weights  # noqa: E402
from workers.types import Request, SamplingParams  # noqa: E402

pytestmark = pytest.mark.triton
if kernels.interpreter_mismatch():
    pytest.skip(kernels.interpreter_mismatch(), allow_module_level=True)
torch.set_num_threads(1)
DEVICE = "cpu" if kernels.interpreting() else "cuda"
V = 97


def tiny_model() -> CausalLM:
    # GQA 2, head_dim 16; std 0.2 gives peaked logits so greedy choices are not float ties
    cfg = ModelConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return init_weights(CausalLM(cfg), seed=0, std=0.2).eval().to(DEVICE)


def run(model: CausalLM, backend: str, block_size: int):
    cfg = EngineConfig(block_size=block_size, kv_cache_tokens=2048, max_batch_size=4,
                       attention_backend=backend, device=DEVICE, dtype="float32",
                       enforce_eager=True)  # each step calls the kernel (graphs replay it)
    g = torch.Generator().manual_seed(1)
    # prompt lengths: 1, within a block, across blocks (not multiples of the block size)
    reqs = [Request(sample_id=i, prompt_ids=torch.randint(0, V, (n,), generator=g),
                    max_tokens=6, min_tokens=6, sampling=SamplingParams(temperature=0.0))
            for i, n in enumerate([1, 7, 40, 21])]
    samples = sorted(generate_all(NativeEngine(cfg, model=model), reqs), key=lambda s: s.sample_id)
    assert all(not s.error for s in samples), [s.error for s in samples]
    return samples


def test_triton_decode_matches_torch_decode(monkeypatch):
    calls = []
    kernel = kernels.paged_decode.paged_decode_attention

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return kernel(*args, **kw)

    monkeypatch.setattr(kernels.paged_decode, "paged_decode_attention", counted)
    model = tiny_model()
    ref = run(model, "torch", 16)
    assert not calls
    out = run(model, "triton", 16)
    # 6 tokens each: 1 from the prefill, 5 decode steps x 2 layers through the kernel, each
    # call taking the whole batch of 4 (one call per layer, not per sequence)
    assert [shape[0] for shape in calls] == [4] * (5 * 2), calls
    for a, b in zip(ref, out):
        assert a.output_ids.tolist() == b.output_ids.tolist(), f"sample {a.sample_id}"
        torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-4, rtol=1e-4)


@pytest.fixture
def replayed_graphs(monkeypatch):
    """The CUDA-graph decode path's buffer handling (padded batch sizes, the scratch block for
    padded rows, static block tables, lazily captured sizes) with the graph itself replaced by
    re-running the captured step: CUDA graphs need a GPU (tests/test_cuda.py replays real ones
    there)."""
    from workers.generation import cuda_graph, model_runner

    class EagerReplay(cuda_graph.DecodeGraphs):  # stands in for torch.cuda.CUDAGraph (GPU only)
        def _capture(self, b):
            out = self._step(b)

            class Replay:
                def replay(_):
                    out.copy_(self._step(b))
            self.graphs[b] = (Replay(), out)
            self.captures += 1

    monkeypatch.setattr(model_runner, "graphs_supported", lambda device, backend: backend == "triton")
    monkeypatch.setattr(cuda_graph, "DecodeGraphs", EagerReplay)


def _graphs_and_eager(work, **cfg) -> NativeEngine:
    """Generates ``work`` ((prompt, forced tokens) per request) with graphs and eagerly: the
    same tokens and log-probs; returns the engine that replayed graphs."""
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    reqs = [Request(sample_id=i, prompt_ids=torch.randint(0, V, (n,), generator=g), max_tokens=m,
                    min_tokens=m, sampling=SamplingParams(temperature=0.0)) for i, (n, m) in enumerate(work)]
    out, engines = {}, {}
    for eager in (False, True):
        engines[eager] = eng = NativeEngine(EngineConfig(device=DEVICE, dtype="float32", attention_backend="triton",
                                                         enforce_eager=eager, **cfg), model=model)
        assert (eng.runner.graphs is None) == eager
        out[eager] = sorted(generate_all(eng, reqs), key=lambda s: s.sample_id)
    for a, b in zip(out[False], out[True]):
        assert a.output_ids.tolist() == b.output_ids.tolist(), f"sample {a.sample_id}"
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
    return engines[False]


def test_graph_decode_buffers_on_cpu(replayed_graphs):
    eng = _graphs_and_eager([(1, 9), (7, 3), (40, 12), (21, 6), (5, 10)], block_size=16, kv_cache_tokens=2048,
                            max_batch_size=3)
    assert eng.runner.graphs.captures == 3  # batch sizes 1, 2, 3 seen as others finished
    assert eng.runner.cache.k[0].shape[0] == eng.bm.num_blocks + 1  # the scratch block


def test_padded_graph_rows_write_only_the_scratch_block(replayed_graphs):
    """Decode batches of 3 replay the graph of 4 (max_batch_size 5: graphs of 1, 2, 4, 5): the
    padded row writes its K/V into the scratch block, not into the slot its last sequence wrote,
    whose blocks a small cache hands to the running sequences (mutation review, session 57)."""
    eng = _graphs_and_eager([(5, 20), (6, 20), (7, 20), (16, 2)], block_size=4, kv_cache_tokens=72,
                            max_batch_size=5, prefix_caching=False)
    assert 4 in eng.runner.graphs.graphs  # batches of 3 ran padded to 4
