"""Small controller pieces without processes: prompt stream resume, atomic checkpoints,
lost-peer classification, weight-push timeouts (the waits on workers and re-dispatch:
tests/test_sgs_rounds.py; the outbox and the release policies: tests/test_sample_stream.py)."""
import json
import os
from pathlib import Path

import pytest

from controller import checkpoint as ckpt
from controller.rpc import is_peer_lost
from workers.types import TaskPrompt

from runtime_helpers import tiny_model  # noqa: F401  (session-wide tiny model folder)


def _items(n):
    return [TaskPrompt(f"p{i}", str(i), "t") for i in range(n)]


def test_checkpoint_is_atomic_and_found(tmp_path):
    root = tmp_path / "run" / "checkpoints"

    def trainer_save(folder):
        os.makedirs(folder)
        with open(f"{folder}/weights", "w") as f:
            f.write("w")

    for it in (2, 4):
        st = ckpt.ControllerState(it, it, {"seed": 0, "epoch": 0, "pos": it}, "stream", [0.1] * it, {})
        ckpt.save(root, st, trainer_save)
    assert ckpt.find(tmp_path / "run").name == "iter_000004"
    assert ckpt.find(root / "iter_000002").name == "iter_000002"
    assert ckpt.load_state(ckpt.find(tmp_path / "run")).stream["pos"] == 4
    assert not list(root.glob(".*tmp*"))  # no temp folders left behind
    ckpt.prune(root, keep=1)
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_000004"]
    assert ckpt.find(tmp_path / "empty") is None


def test_lost_peer_vs_worker_exception():
    assert is_peer_lost(RuntimeError("eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)"))
    assert not is_peer_lost(ValueError("On WorkerInfo(id=1, name=worker1):\nValueError('closed form')"))


def test_data_plane_backend_nccl_only_with_a_gpu_per_rank(capsys):
    import torch

    from controller.processes import data_plane_backend

    assert data_plane_backend(torch.device("cpu"), 3, 0) == "gloo"
    assert data_plane_backend(torch.device("cuda", 0), 8, 8) == "nccl"
    # the quickstart's 3 ranks on a 1-GPU machine: NCCL would refuse ("Duplicate GPU detected")
    assert data_plane_backend(torch.device("cuda", 0), 3, 1) == "gloo"
    assert "3 ranks share 1 GPU" in capsys.readouterr().err


def test_thread_cpu_names_native_threads_by_their_os_name():
    # a native thread that ran Python code appears in `threading` as "Dummy-N" only once it
    # has: named by its OS name, two snapshots agree on it (benchmarks difference them)
    import _thread
    import threading

    from controller.process_state import thread_cpu

    seen, done = threading.Event(), threading.Event()

    def native():
        threading.current_thread()  # registers a _DummyThread for this native thread
        seen.set()
        done.wait()

    _thread.start_new_thread(native, ())
    seen.wait()
    try:
        assert any(isinstance(t, threading._DummyThread) for t in threading.enumerate())
        snap = thread_cpu()
        assert snap and not any(k.startswith("Dummy-") for k in snap), snap
        per_thread = sum(v for k, v in snap.items() if k != "total")
        assert per_thread <= snap["total"] + 0.05  # live threads' CPU within the process's
    finally:
        done.set()


def test_prompt_template_reaches_a_built_model_and_overrides_a_loaded_one(tmp_path):
    from controller.bootstrap import ensure_model
    from workers.tokenizer import Tokenizer

    init = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 300}
    out = ensure_model(str(tmp_path / "m"), init, "synthetic", {"num_train": 64}, 0, 1e-3, 0, "Q: {prompt}\nA:")
    assert out["built"] and out["path"] == str(tmp_path / "m")
    tok = Tokenizer.load(tmp_path / "m")  # saved with the folder: what its SFT and later runs see
    assert tok.format_prompt("1 + 2") == "Q: 1 + 2\nA:"
    assert Tokenizer.load(tmp_path / "m", "<{prompt}>").format_prompt("x") == "<x>"  # the config's override
    again = ensure_model(str(tmp_path / "m"), init, "synthetic", {}, 0, 1e-3, 0, None)
    assert not again["built"]  # an existing model folder is used as is


def test_a_version_staged_while_the_previous_one_loads_is_kept(tiny_model):  # noqa: F811
    # the weight push of version v+1 runs on an RPC thread while the instance still loads v
    # (vLLM's reload takes ~1 s): v+1 must survive the swap, or the next generate fails
    import torch

    from controller.instance import GenerationInstance
    from workers.generation.config import EngineConfig

    torch.set_num_threads(1)
    inst = GenerationInstance(1, EngineConfig(device="cpu", kv_cache_tokens=1024), tiny_model, [0])
    weights = {k: v.detach().clone() for k, v in inst.engine.model.named_parameters()}
    inst.stage_weights(weights, 1)
    load = inst.engine.load_weights

    def slow_load(named, version):
        inst.stage_weights({k: v + 1 for k, v in weights.items()}, 2)  # arrives mid-load
        load(named, version)

    inst.engine.load_weights = slow_load
    inst._swap_weights(1)
    assert inst.version == 1 and inst._staged[0] == 2
    inst.engine.load_weights = load
    inst._swap_weights(2)
    assert inst.version == 2 and inst._staged is None and inst.engine.stats().weight_version == 2
    assert all(torch.equal(p, weights[k] + 1) for k, p in inst.engine.model.named_parameters())


def test_a_model_folder_is_checked_before_any_work(tmp_path, tiny_model):  # noqa: F811
    import shutil

    import pytest

    from controller.config import ConfigError
    from controller.preflight import check_model_folder

    check_model_folder(Path(tiny_model))  # a good folder
    check_model_folder(tmp_path / "not_built_yet", {"hidden_size": 64})  # model.init builds it later
    # a mistyped path without model.init: one line here, not the bootstrap's remote traceback
    with pytest.raises(ConfigError, match=r"^model.path: .*not_built_yet does not exist and model.init is not set"):
        check_model_folder(tmp_path / "not_built_yet")
    with pytest.raises(ConfigError, match=r"^model.path: .*gpt2 holds no config.json and model.init is not set"):
        (tmp_path / "gpt2").mkdir()
        check_model_folder(tmp_path / "gpt2")
    (tmp_path / "gpt2").rmdir()
    # a path the built model cannot be written to was found when saving it, after the whole SFT (s51)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"^model.path: .*afile/model: .*afile is a file, and model.init builds"):
        check_model_folder(tmp_path / "afile" / "model", {"hidden_size": 64})
    with pytest.raises(ConfigError, match=r"^model.init.hidden: unknown key"):
        check_model_folder(tmp_path / "not_built_yet", {"hidden": 64})
    # checked here, not as two remote tracebacks from the trainer ranks' bootstrap (vocab) or
    # a message naming no key (types)
    with pytest.raises(ConfigError, match=r"^model.init.vocab_size: 200 is below 258, the least the bootstrap's"):
        check_model_folder(tmp_path / "not_built_yet", {"vocab_size": 200})
    with pytest.raises(ConfigError, match=r"^model.init.hidden_size: expected int, got str 'abc'"):
        check_model_folder(tmp_path / "not_built_yet", {"hidden_size": "abc"})
    with pytest.raises(ConfigError, match=r"^model.init.hidden_size: expected int, got float 128.0"):
        check_model_folder(tmp_path / "not_built_yet", {"hidden_size": 128.0})
    with pytest.raises(ConfigError, match=r"^model.init: model.num_attention_heads \(3\) must be a multiple"):
        check_model_folder(tmp_path / "not_built_yet", {"num_attention_heads": 3})
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_model, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"^model.path: .*gpt2/config.json: architecture "
                                          r"'GPT2LMHeadModel' is not supported"):
        check_model_folder(gpt2)
    notok = tmp_path / "notok"
    shutil.copytree(tiny_model, notok)
    (notok / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"model.path: .*notok has no tokenizer.json"):
        check_model_folder(notok)


def test_a_refused_eval_leaves_nothing_queued_for_the_next_generate(tiny_model):  # noqa: F811
    # a REPL eval with one over-long prompt is refused; its accepted requests must not stay
    # in the engine and come out of the next generate() as training samples
    import pytest
    import torch

    from controller.instance import GenerationInstance
    from workers.generation.config import EngineConfig
    from workers.types import Request, SamplingParams

    torch.set_num_threads(1)
    inst = GenerationInstance(1, EngineConfig(device="cpu", kv_cache_tokens=1024, max_model_len=64), tiny_model, [0])
    greedy = SamplingParams(temperature=0.0)
    ok = [Request(sample_id=i, prompt_ids=torch.tensor([1, 2, 3]), max_tokens=4, sampling=greedy) for i in (0, 1)]
    long = Request(sample_id=2, prompt_ids=torch.ones(80, dtype=torch.int64), max_tokens=4, sampling=greedy)
    with pytest.raises(ValueError, match="refused eval request 2"):
        inst.evaluate([*ok, long])
    assert not inst.engine.has_work()
    assert [sid for sid, _ in inst.evaluate(ok).outputs] == [0, 1]  # the same ids are accepted again


def test_repl_mode_switch_refuses_a_mode_whose_lag_max_staleness_forbids():
    """max_staleness 0: an async mode (lag 1) would skip every sample as stale; the REPL's
    `mode` answers with the reason and the run keeps its mode."""
    from types import SimpleNamespace

    from controller.modes import get_mode
    from controller.switches import switch_mode

    prog = SimpleNamespace()
    prog.cfg = SimpleNamespace(trainer=SimpleNamespace(max_staleness=0))
    prog.world = SimpleNamespace(colocated=False)
    prog.mode = get_mode("stream")
    with pytest.raises(ValueError, match="trainer.max_staleness: 0 is below the lag of pipeline.mode async_stream"):
        switch_mode(prog, "async_stream")
    assert prog.mode.name == "stream"
    switch_mode(prog, "batch")
    assert prog.mode.name == "batch"


def test_a_weight_push_gives_up_on_a_stuck_peer_after_rpc_timeout_s(monkeypatch):
    """Both ends of a tree push wait for a bucket at most ``placement.rpc_timeout_s`` (what
    docs/controller.md says of a worker frozen during a push), not the executor's own 600 s
    default, which they used before. The executor's timeouts themselves: test_weight_sync_edges."""
    import threading
    from types import SimpleNamespace

    import torch

    import workers.weight_sync as ws
    from controller.instance import GenerationInstance
    from controller.process_state import LOCAL
    from controller.timeline import SpanRecorder
    from controller.trainer_rank import TrainerRank

    given = {}

    class Sender:
        def __init__(self, plan, rank, timeout_s=600.0, **kw):
            given["sender"] = timeout_s

        def push(self, named, version):
            return None

    class Receiver:
        def __init__(self, plan, rank, timeout_s=600.0, **kw):
            given["receiver"], self.plan = timeout_s, plan

        def receive(self):
            return SimpleNamespace(ok=True, version=1, tensors={"w": torch.zeros(2)}, error="")

    monkeypatch.setattr(ws, "WeightSyncSender", Sender)
    monkeypatch.setattr(ws, "WeightSyncReceiver", Receiver)
    monkeypatch.setattr(LOCAL, "rpc_timeout_s", 7.0)
    trainer = TrainerRank.__new__(TrainerRank)
    trainer.rank, trainer.spans = 2, SpanRecorder("train2")
    trainer.worker = SimpleNamespace(version=1, named_weights=lambda: iter([("w", torch.zeros(2))]))
    trainer.push_weights(SimpleNamespace(slots=()), 1)
    inst = GenerationInstance.__new__(GenerationInstance)
    inst.rank, inst.spans, inst._receiver, inst._staged, inst._staging = 1, SpanRecorder("gen1"), None, None, \
        threading.Lock()
    assert inst.receive_weights("plan") == 1
    assert given == {"sender": 7.0, "receiver": 7.0}


def test_an_evaluate_call_stops_when_cancelled(tiny_model):  # noqa: F811
    # controller.evaluation cancels the shares of a failed evaluation: the instance stops at
    # its next step, leaves nothing queued, and a cancel that came before the call (queued
    # behind another) means it does not start; other tokens are untouched
    import torch

    from controller.instance import GenerationInstance
    from workers.generation.config import EngineConfig
    from workers.types import Request, SamplingParams

    torch.set_num_threads(1)
    inst = GenerationInstance(1, EngineConfig(device="cpu", kv_cache_tokens=2048), tiny_model, [0])
    greedy = SamplingParams(temperature=0.0)
    reqs = [Request(sample_id=-1 - i, prompt_ids=torch.tensor([1, 2, 3]), max_tokens=40, min_tokens=40,
                    sampling=greedy) for i in range(4)]
    step, steps = inst.engine.step, []

    def counted_step():
        steps.append(1)
        if len(steps) == 3:  # the controller's cancel arrives (an RPC thread) mid-call
            inst.cancel("eval-a")
        return step()

    inst.engine.step = counted_step
    out = inst.evaluate(reqs, token="eval-a")
    assert out.cancelled and out.outputs == [] and len(steps) == 3
    assert not inst.engine.has_work()
    inst.cancel("eval-b")  # before its call starts
    assert inst.evaluate(reqs, token="eval-b").cancelled and len(steps) == 3
    inst.cancel("eval-stale")  # a cancel for a call that ended already changes nothing later
    done = inst.evaluate(reqs, token="eval-c")
    assert not done.cancelled and sorted(sid for sid, ids in done.outputs if len(ids) == 40) == [-4, -3, -2, -1]


def test_a_length_trace_with_other_fields_is_a_config_error(tmp_path):
    # a file with the wrong fields passed the load check (it exists) and was a TraceError traceback
    from controller.config import ConfigError
    from controller.length_trace import forced_lengths

    bad = tmp_path / "t.jsonl"
    bad.write_text('{"q": "x", "lens": [3]}\n')
    with pytest.raises(ConfigError, match=rf"^train.length_trace: {bad}:1: missing field 'question'"):
        forced_lengths(str(bad), 1.0, 64)
    good = tmp_path / "g.jsonl"
    good.write_text('{"question": "x", "resp_words": [10]}\n')
    assert forced_lengths(str(good), 1.0, 64)(TaskPrompt("anything", "", "t")) == 13


def test_the_extra_groups_of_an_iteration_rotate_over_the_trainer_ranks():
    """9 prompts on 8 trainer ranks: rank 0 took two groups at every step (SAMPLE_STRIDE is a
    multiple of 8); now each rank takes the extra one in turn."""
    from collections import Counter

    from controller.outbox import route
    from workers.types import SAMPLE_STRIDE

    extra = []
    for it in range(8):
        load = Counter(route(it * SAMPLE_STRIDE + j, 8) for j in range(9))
        assert sorted(load.values()) == [1] * 7 + [2]
        extra += [r for r, n in load.items() if n == 2]
    assert sorted(extra) == list(range(8))


def test_a_joiner_holds_the_weights_it_pulled_once_added(tiny_model):  # noqa: F811
    """add_instance only staged the pulled weights: the joiner held the model folder's (v0) until
    its first round, and an evaluation before that scored them (eval.jsonl: weight_version [0, 1])."""
    import torch

    from controller.instance import GenerationInstance
    from workers.generation.config import EngineConfig

    torch.set_num_threads(1)
    inst = GenerationInstance(1, EngineConfig(device="cpu", kv_cache_tokens=1024), tiny_model, [0])
    weights = {k: v.detach().clone() + 0.01 for k, v in inst.engine.model.named_parameters()}
    inst.stage_weights(weights, 3)
    assert inst.version == 0
    assert inst.hold_weights(3) == 3 and inst.engine.stats().weight_version == 3 and inst._staged is None
    k, w = next(iter(weights.items()))
    assert torch.equal(dict(inst.engine.model.named_parameters())[k], w)


def test_a_task_named_as_an_eval_aggregate_keeps_its_own_score(monkeypatch):
    """A task (data_source) named "mean" had its eval/mean overwritten by the overall mean, one
    named "unscored" read as a count (review, session 51): they are eval/task:<name>."""
    from types import SimpleNamespace

    import torch

    from controller import evaluation
    from controller.config import LoggingSection, MultiTurnSection
    from workers.types import SamplingParams

    test = [TaskPrompt("q0", "0", "mean"), TaskPrompt("q1", "1", "other"), TaskPrompt("q2", "2", "unscored")]
    monkeypatch.setattr(evaluation, "side_generate",
                        lambda program, reqs, **kw: ({r.sample_id: [1] for r in reqs}, (0,)))
    train = SimpleNamespace(seed=0, max_tokens=8, eval_samples=1, eval_temperature=0.0)
    trainer = SimpleNamespace(reward_workers=1, reward_pool="threads", reward_timeout_s=None, reward_batch_size=None)
    cfg = SimpleNamespace(train=train, multi_turn=MultiTurnSection(), logging=LoggingSection(), trainer=trainer,
                          task=SimpleNamespace(name="synthetic", kwargs={}))
    task = SimpleNamespace(prompts=lambda split: test, score=lambda item, text: float(item.task == "mean"))
    program = SimpleNamespace(cfg=cfg, task=task, eval_pool=None, tok=SimpleNamespace(decode=lambda ids, **kw: "x"),
                              prompt_ids=lambda item: torch.tensor([1, 2]),
                              sampling=lambda t, seed: SamplingParams(temperature=t, seed=seed))
    scores = evaluation.evaluate(program, 0).scores
    assert {k: v for k, v in scores.items() if k.count("/") == 1} == \
        {"eval/task:mean": 1.0, "eval/other": 0.0, "eval/task:unscored": 0.0, "eval/mean": 1 / 3}
    assert scores["eval/task:mean/reward/mean@1"] == 1.0  # its statistics under the same key


@pytest.mark.parametrize("forced", [True, False])
def test_the_ranker_bootstrap_measures_lengths_bounded_as_training_bounds_them(monkeypatch, forced):
    """The bootstrap asked for min_tokens 0 and train.max_tokens, while training forces
    train.min_tokens, or each prompt's trace length under train.length_trace: the ranker was fit on
    lengths the run never generates, and its online update learned others (review, s54)."""
    from controller import evaluation
    from controller.config import MultiTurnSection
    from types import SimpleNamespace

    from controller.program import Program

    natural = 7  # an engine's output when nothing forces it: clamped to [min_tokens, max_tokens]
    monkeypatch.setattr(evaluation, "side_generate", lambda program, reqs, **kw: (
        {r.sample_id: [0] * min(max(natural, r.min_tokens), r.max_tokens) for r in reqs}, (0,)))
    prog = Program.__new__(Program)
    prog.cfg = SimpleNamespace(train=SimpleNamespace(group_size=2, max_tokens=256, min_tokens=12, temperature=1.0,
                                                     seed=0, top_k=0, top_p=1.0, overlong_prompts="error",
                                                     max_prompt_tokens=0),
                               multi_turn=MultiTurnSection())
    prog.tok = SimpleNamespace(encode_prompt=lambda prompt, messages=None: [1, 2, 3])
    lens = {"p1": 100, "p2": 40}
    prog.length_of = (lambda item: lens[item.prompt]) if forced else None
    got = evaluation.measure_lengths(prog, [TaskPrompt("p1", "1", "t"), TaskPrompt("p2", "2", "t")])
    assert got == ([100.0, 40.0] if forced else [12.0, 12.0])  # what Program._requests generates
