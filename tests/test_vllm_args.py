"""The EngineConfig/Request -> vLLM mapping (pure; runs without vLLM installed)."""
import os

import pytest
import torch

from workers.generation import vllm_args, vllm_process
from workers.generation.config import EngineConfig
from workers.model import CausalLM, ModelConfig
from workers.types import Request, SamplingParams

MC = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)


def test_engine_args_cpu():
    cfg = EngineConfig(backend="vllm", max_batch_size=8, block_size=16, kv_cache_tokens=4096,
                       admission="lpt", device="cpu", max_prefill_tokens=100,
                       backend_options={"max_num_seqs": 32, "multiprocess": True})
    a = vllm_args.engine_args(cfg, "/m", MC)
    assert a["block_size"] == 32 and a["num_gpu_blocks_override"] == 128  # 4096 tokens
    assert a["kv_cache_memory_bytes"] == 128 * 32 * (2 * 2 * 1 * 32 * 4)
    assert a["max_num_seqs"] == 32 and "multiprocess" not in a
    assert a["max_num_batched_tokens"] == 512 and a["dtype"] == "float32"  # unchunked on CPU: below
    assert a["scheduling_policy"] == "priority" and a["enable_prefix_caching"]
    assert a["skip_tokenizer_init"] and a["logprobs_mode"] == "processed_logprobs"
    assert a["max_model_len"] == 512 and a["kv_cache_dtype"] == "auto"


def test_vllm_on_cpu_prefills_each_prompt_in_one_step():
    # vLLM 0.32 rewinds a seeded request's generator when it splits a prompt over steps, which CPU
    # generators refuse ("CPU Generator does not use offset"): every seeded batch of prompts past
    # one step's budget failed its round (review, s54). On CUDA it chunks as asked.
    cpu = vllm_args.engine_args(EngineConfig(backend="vllm", device="cpu", kv_cache_tokens=4096,
                                             max_prefill_tokens=100), "/m", MC)
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == cpu["max_model_len"] == 512
    gpu = vllm_args.engine_args(EngineConfig(backend="vllm", device="cuda", kv_cache_tokens=4096,
                                             max_prefill_tokens=100), "/m", MC)
    assert gpu["enable_chunked_prefill"] is True and gpu["max_num_batched_tokens"] == 256  # max_num_seqs
    # backend_options do not undo it silently (review, s54)
    for opts, said in (({"enable_chunked_prefill": True}, "backend_options.enable_chunked_prefill: vLLM 0.32 on CPU"),
                       ({"max_num_batched_tokens": 256}, "backend_options.max_num_batched_tokens: 256 is below "
                                                         "max_model_len 512")):
        with pytest.raises(ValueError, match=said):
            vllm_args.engine_args(EngineConfig(backend="vllm", device="cpu", kv_cache_tokens=4096,
                                               backend_options=opts), "/m", MC)
    assert vllm_args.engine_args(EngineConfig(backend="vllm", device="cuda", kv_cache_tokens=4096, backend_options={
        "max_num_batched_tokens": 256}), "/m", MC)["max_num_batched_tokens"] == 256  # chunked on CUDA: taken


def test_chunked_prefill_off_reaches_vllm_with_a_budget_that_holds_a_whole_prompt():
    # engine.enable_chunked_prefill: false was dropped (vLLM chunked anyway); vLLM without chunks
    # refuses a step budget below max_model_len, so the budget grows to it (review, session 47)
    cfg = EngineConfig(backend="vllm", max_batch_size=8, kv_cache_tokens=4096, device="cpu", max_prefill_tokens=100,
                       enable_chunked_prefill=False)
    a = vllm_args.engine_args(cfg, "/m", MC)
    assert a["enable_chunked_prefill"] is False and a["max_num_batched_tokens"] == a["max_model_len"] == 512


def test_max_model_len_capped_so_one_sequence_fits_the_cache():
    # as the native engine: all KV blocks but one (vLLM refuses to start when a sequence of
    # max_model_len cannot fit); 4096 tokens = 128 blocks of 32 -> 127 x 32
    big = ModelConfig(**{**MC.__dict__, "max_position_embeddings": 8192})
    cfg = EngineConfig(backend="vllm", block_size=16, kv_cache_tokens=4096, device="cpu")
    assert vllm_args.max_model_len(cfg, big) == 127 * 32
    assert vllm_args.engine_args(cfg, "/m", big)["max_model_len"] == 127 * 32
    assert vllm_args.max_model_len(EngineConfig(backend="vllm", kv_cache_tokens=4096, max_model_len=1000,
                                                device="cpu"), big) == 1000
    # a max_model_len set in the config that the cache cannot hold is refused (EngineConfig, in
    # native blocks: 255 x 16 = 4080); in vLLM's CPU blocks of 32 it holds less (127 x 32 = 4064)
    with pytest.raises(ValueError, match=r"engine.max_model_len: 4090 tokens do not fit the KV cache, whose "
                                         r"256 blocks of 16 tokens hold at most 4080 tokens"):
        EngineConfig(backend="vllm", kv_cache_tokens=4096, max_model_len=4090, device="cpu")
    with pytest.raises(ValueError, match=r"engine.max_model_len: 4070 tokens do not fit the KV cache, whose "
                                         r"128 vLLM blocks of 32 tokens hold at most 4064 tokens"):
        vllm_args.max_model_len(EngineConfig(backend="vllm", kv_cache_tokens=4096, max_model_len=4070,
                                             device="cpu"), big)
    # past the model's context (512): refused as the native engine does (vLLM refuses it at start)
    with pytest.raises(ValueError, match=r"engine.max_model_len: 1000 is past the model's context \(max_position_"
                                         r"embeddings 512"):
        vllm_args.max_model_len(EngineConfig(backend="vllm", kv_cache_tokens=4096, max_model_len=1000, device="cpu"), MC)
    with pytest.raises(ValueError, match=r"engine.max_model_len: 513 is past the model's context"):
        vllm_args.max_model_len(EngineConfig(backend="vllm", kv_cache_tokens=4096, max_model_len=513, device="cpu"), MC)
    assert vllm_args.max_model_len(EngineConfig(backend="vllm", kv_cache_tokens=4096, max_model_len=512,
                                                device="cpu"), MC) == 512


def test_a_context_vllms_blocks_cannot_hold_is_said_at_config_load(monkeypatch):
    """1008 tokens fit the native engine's 16-token blocks, not vLLM's 32-token CPU blocks (992):
    it was said only as each instance was built (review, session 50)."""
    from workers.generation import support

    cfg = EngineConfig(backend="vllm", block_size=16, kv_cache_tokens=1024, max_model_len=1008, device="cpu")
    said = ("engine.max_model_len: 1008 tokens do not fit the KV cache, whose 32 vLLM blocks of 32 tokens hold "
            "at most 992")
    assert said in vllm_args.context_problem(cfg)
    monkeypatch.setattr(support.importlib.util, "find_spec", lambda name: object())  # vLLM "installed"
    assert said in support.engine_problem(cfg, "rank 1 (generation)")
    assert vllm_args.context_problem(EngineConfig(backend="vllm", block_size=16, kv_cache_tokens=1024,
                                                  max_model_len=992, device="cpu")) is None


def test_engine_args_refusals():
    with pytest.raises(ValueError, match="head_dim 16"):
        vllm_args.engine_args(EngineConfig(backend="vllm", device="cpu"), "/m",
                              ModelConfig(hidden_size=64, num_attention_heads=4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        vllm_args.engine_args(EngineConfig(backend="vllm", device="cpu", max_batch_size=8,
                                           backend_options={"max_num_seqs": 4}), "/m", MC)
    with pytest.raises(ValueError, match="engine.kv_cache_dtype: vLLM's CPU attention takes only 'auto'"):
        vllm_args.engine_args(EngineConfig(backend="vllm", device="cpu", kv_cache_dtype="bfloat16"), "/m", MC)


def test_engine_args_kv_cache_dtype_on_gpu():
    a = vllm_args.engine_args(EngineConfig(backend="vllm", device="cuda", dtype="float32", block_size=16,
                                           kv_cache_tokens=4096, kv_cache_dtype="bfloat16"), "/m", MC)
    assert a["kv_cache_dtype"] == "bfloat16"
    assert a["kv_cache_memory_bytes"] == a["num_gpu_blocks_override"] * a["block_size"] * (2 * 2 * 1 * 32 * 2)
    assert a["enforce_eager"] is False  # CUDA graphs on a GPU, unless the config says otherwise
    eager = EngineConfig(backend="vllm", device="cuda", block_size=16, enforce_eager=True)
    assert vllm_args.engine_args(eager, "/m", MC)["enforce_eager"] is True


def test_priority_is_lpt_and_sampling_kwargs():
    reqs = [Request(sample_id=i, prompt_ids=torch.tensor([1]), max_tokens=4, est_len=e)
            for i, e in enumerate([0.25, 3.0, 0.5])]
    pri = [vllm_args.priority(r, "lpt") for r in reqs]
    assert sorted(range(3), key=pri.__getitem__) == [1, 2, 0]
    assert {vllm_args.priority(r, "fcfs") for r in reqs} == {0}
    # an estimate past the int range is clamped before rounding (round(1e303 * 1e6) raised
    # OverflowError inside step(), losing the step's finished samples)
    huge = [Request(sample_id=0, prompt_ids=torch.tensor([1]), max_tokens=4, est_len=e) for e in (1e303, 1e308)]
    assert [vllm_args.priority(r, "lpt") for r in huge] == [-2 ** 62, -2 ** 62]
    r = Request(sample_id=0, prompt_ids=torch.tensor([1]), max_tokens=6, min_tokens=6,
                sampling=SamplingParams(temperature=0.5, top_k=0, top_p=0.9, seed=4))
    kw = vllm_args.sampling_kwargs(r, (7, 9))
    assert kw["stop_token_ids"] == [7, 9] and not kw["ignore_eos"] and kw["logprobs"] == 0
    assert (kw["min_tokens"], kw["max_tokens"], kw["seed"], kw["n"]) == (6, 6, 4, 1)
    assert vllm_args.sampling_kwargs(r, ())["ignore_eos"]
    # on CPU a seed of 2**32 or more is folded as the native sampler folds it (vLLM's CPU generator
    # keeps the low 32 bits: seeds 2**32 apart drew alike; review, session 51); on CUDA it is sent whole
    from workers.generation.sampler import cpu_seed

    big = Request(sample_id=0, prompt_ids=torch.tensor([1]), max_tokens=2, sampling=SamplingParams(seed=4 + 2**32))
    assert vllm_args.sampling_kwargs(big, (), on_cpu=False)["seed"] == 4 + 2**32
    assert vllm_args.sampling_kwargs(big, (), on_cpu=True)["seed"] == cpu_seed(4 + 2**32) != 4
    assert vllm_args.sampling_kwargs(r, (), on_cpu=True)["seed"] == 4


@pytest.mark.parametrize("t, sent", [(0.0, 0.0), (1e-45, 0.0), (1e-6, 0.0), (9.99e-6, 0.0),
                                     (0.01, 0.01), (0.5, 0.5), (2.0, 2.0)])
def test_near_zero_temperature_is_sent_as_greedy(t, sent):
    # the native sampler is greedy below GREEDY_BELOW (log-probs at T=1); vLLM would raise
    # 0 < T < 0.01 to 0.01 and report log-probs at 0.01
    r = Request(sample_id=0, prompt_ids=torch.tensor([1]), max_tokens=2,
                sampling=SamplingParams(temperature=t))
    assert vllm_args.sampling_kwargs(r, ())["temperature"] == sent


def test_fused_modules_must_be_whole():
    names = {n for n, _ in CausalLM(MC).named_parameters()}
    assert vllm_args.incomplete_modules(names, names) == {}
    assert vllm_args.incomplete_modules({"model.norm.weight"}, names) == {}
    miss = vllm_args.incomplete_modules({"model.layers.1.mlp.up_proj.weight"}, names)
    assert miss == {"model.layers.1.mlp.gate_up_proj": ["model.layers.1.mlp.gate_proj.weight"]}
    qkv = vllm_args.incomplete_modules({"model.layers.0.self_attn.q_proj.weight"}, names)
    assert "model.layers.0.self_attn.k_proj.bias" in qkv["model.layers.0.self_attn.qkv_proj"]


def test_gpu_memory_utilization_is_the_share_free_now(monkeypatch):
    """On a GPU the KV cache is sized by bytes, and vLLM's utilization only refuses a start with
    less than that share free: 0.9 failed beside a colocated trainer holding over 10%. (No GPU
    here: torch.cuda's is_available and mem_get_info are faked, which is what the rule reads.)"""
    import torch

    for free, want in ((40e9, 0.475), (79e9, 0.9), (8e9, 0.095)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # (no LOCAL_RANK here: the current GPU)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, f=free: (f, 80e9))
        assert vllm_args.gpu_memory_utilization("cuda:0") == want
        cfg = EngineConfig(backend="vllm", kv_cache_tokens=4096, device="cuda", dtype="bfloat16")
        assert vllm_args.engine_args(cfg, "/m", MC)["gpu_memory_utilization"] == want
    cfg = EngineConfig(backend="vllm", kv_cache_tokens=4096, device="cuda", dtype="bfloat16",
                       backend_options={"gpu_memory_utilization": 0.5})
    assert vllm_args.engine_args(cfg, "/m", MC)["gpu_memory_utilization"] == 0.5


def _alone(monkeypatch, ve) -> None:
    """As in a process of its own: no torch.distributed world, no other in-process engine (an
    engine of an earlier test in this process may still be alive)."""
    import torch

    monkeypatch.setattr(ve, "IN_PROCESS", [0])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)


def test_an_engine_beside_shared_process_state_starts_a_child(monkeypatch):
    """An in-process engine core's close() destroyed the caller's process group and tore down the
    parallel groups another in-process engine stepped in (review, session 52): beside either, a
    child; multiprocess: false there is refused."""
    import torch

    from workers.generation import vllm_process as ve

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    _alone(monkeypatch, ve)
    cpu = EngineConfig(backend="vllm", device="cpu")
    assert not ve.use_subprocess(cpu)
    monkeypatch.setattr(ve, "IN_PROCESS", [1])
    assert ve.use_subprocess(cpu)
    with pytest.raises(ValueError, match="multiprocess: false, but another vLLM engine runs in this process"):
        ve.use_subprocess(EngineConfig(backend="vllm", device="cpu", backend_options={"multiprocess": False}))
    monkeypatch.setattr(ve, "IN_PROCESS", [0])
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert ve.use_subprocess(cpu)
    with pytest.raises(ValueError, match="multiprocess: false, but torch.distributed is initialized"):
        ve.use_subprocess(EngineConfig(backend="vllm", device="cpu", backend_options={"multiprocess": False}))


def test_a_vllm_instance_computes_on_its_own_gpu(monkeypatch):
    """vLLM's one-process executor binds cuda:0 whatever engine.device said, so every instance of
    a node computed on GPU 0 (review, session 50). The engine core now starts in a child that sees
    the instance's GPU alone. (No GPU here: the mapping is checked, not a run on a GPU.)"""
    from workers.generation import vllm_process as ve

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _alone(monkeypatch, ve)
    cpu, one = EngineConfig(backend="vllm", device="cpu"), EngineConfig(backend="vllm", device="cuda:1")
    assert ve.gpu_index(cpu) is None and not ve.use_subprocess(cpu)
    assert ve.gpu_index(one) == 1 and ve.use_subprocess(one) and ve.child_gpu(1) == "1"
    assert not ve.use_subprocess(EngineConfig(backend="vllm", device="cuda:0"))  # in-process: vLLM's cuda:0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # the parent's cuda:1 is physical GPU 6
    assert ve.child_gpu(1) == "6"
    with pytest.raises(ValueError, match="engine.device cuda:2: CUDA_VISIBLE_DEVICES=4,6 shows 2 GPU"):
        ve.child_gpu(2)


def test_vllms_multiprocessing_variable_makes_the_backend_set_up_a_child(monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 makes vLLM start a child whatever it is asked; the backend
    took itself for in-process, left the child's settings unmade and every weight push failed
    ('functools.partial is not serializable')."""
    from workers.generation import vllm_process as ve

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert ve.use_subprocess(EngineConfig(backend="vllm", device="cpu", backend_options={"multiprocess": False}))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _alone(monkeypatch, ve)
    assert not ve.use_subprocess(EngineConfig(backend="vllm", device="cpu"))


def test_every_projection_of_a_fused_module_is_required():
    """vLLM reloads qkv_proj / gate_up_proj only whole: leaving out any one of q/k/v or gate/up is named."""
    names = {n for n, _ in CausalLM(MC).named_parameters()}
    for layer in (0, 1):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        for left_out in ("q_proj", "k_proj", "v_proj"):
            sent = {n for n in names if n.startswith(attn + ".") and f".{left_out}." not in n}
            assert {n for ns in vllm_args.incomplete_modules(sent, names).values() for n in ns} == \
                {n for n in names if n.startswith(f"{attn}.{left_out}.")}
        for left_out in ("gate_proj", "up_proj"):
            sent = {n for n in names if n.startswith(mlp + ".") and f".{left_out}." not in n}
            assert vllm_args.incomplete_modules(sent, names) == {f"{mlp}.gate_up_proj": [f"{mlp}.{left_out}.weight"]}


def test_prefix_caching_is_on_when_either_switch_is():
    """EngineConfig: vLLM has one mechanism for prefix_sharing and prefix_caching and turns it on when either is true."""
    on = [(s, c) for s in (False, True) for c in (False, True)
          if vllm_args.engine_args(EngineConfig(backend="vllm", device="cpu", kv_cache_tokens=4096,
                                                prefix_sharing=s, prefix_caching=c), "/m", MC)["enable_prefix_caching"]]
    assert on == [(False, True), (True, False), (True, True)]


def test_cuda_defaults_to_bfloat16_as_the_native_engine():
    assert vllm_args.resolve_device_dtype(EngineConfig(backend="vllm", device="cuda")) == ("cuda", "bfloat16")
    assert vllm_args.resolve_device_dtype(EngineConfig(backend="vllm", device="cpu")) == ("cpu", "float32")
    assert vllm_args.engine_args(EngineConfig(backend="vllm", device="cuda", kv_cache_tokens=4096),
                                 "/m", MC)["dtype"] == "bfloat16"


def test_sampling_kwargs_send_top_p_and_top_k():
    def kw(**sp):
        return vllm_args.sampling_kwargs(Request(0, torch.tensor([1]), 4, sampling=SamplingParams(**sp)), ())
    assert (kw(temperature=0.7, top_p=0.8, top_k=40)["top_p"], kw(temperature=0.7, top_p=0.8, top_k=40)["top_k"]) == (0.8, 40)
    assert kw(temperature=0.7, top_k=0)["top_k"] == 0 and kw(temperature=0.7, top_k=-1)["top_k"] == 0


def test_the_engine_core_child_gets_the_callers_threads_and_its_gpu(monkeypatch):
    """child_env: a spawned engine core reads OMP_NUM_THREADS and CUDA_VISIBLE_DEVICES from the
    environment only; both are set while it starts and restored after. (No GPU here: gpu_index is
    faked to the cuda:1 a config would name.)"""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(vllm_process, "gpu_index", lambda cfg: 1)
    with vllm_process.child_env(EngineConfig(backend="vllm", device="cpu"), subprocess=True):
        assert (os.environ["OMP_NUM_THREADS"], os.environ["CUDA_VISIBLE_DEVICES"]) == ("3", "6")
    assert (os.environ["OMP_NUM_THREADS"], os.environ["CUDA_VISIBLE_DEVICES"]) == ("1", "4,6")
    with pytest.raises(ValueError, match="in-process executor computes on cuda:0"):
        with vllm_process.child_env(EngineConfig(backend="vllm", device="cpu"), subprocess=False):
            pass
