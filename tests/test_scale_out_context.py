"""A generation instance that joins at run time (scale-out) with a smaller context
(max_model_len) than the starting instances: without a check it takes kept prompts it cannot
serve, and its round fails (the run stops, exit 1) or its outputs are cut shorter than the
others'; with the check made at start (``ContextNeed``) the SGS refuses it, naming it, and the
run goes on. Real engines on the tiny model, in this process: a handle's ``call`` runs the
instance's method here and returns its result (or exception) as a finished RPC future."""
import json
from types import SimpleNamespace

import pytest
import torch

from controller.config import TrainSection
from controller.prompt_fit import ContextNeed, ContextTooSmall, fitting_prompts
from controller.rpc import WorkerFailed, WorkerHandle
from controller.scheduling import make_dispatcher
from controller.sgs import SGS
from tests.runtime_helpers import LocalRRef, SinkTrainer, tiny_model  # noqa: F401
from workers.types import Request, TaskPrompt

PROMPT = 300  # tokens of the long prompt; train.max_tokens 8: it needs a context of 308


def _instance(rank, kv_cache_tokens, model_dir, sink):
    """max_model_len = (kv_cache_tokens // 16 - 1) * 16: 1024 -> 1008, 336 -> 320, 320 -> 304, 256 -> 240."""
    from controller.instance import GenerationInstance
    from workers.generation.config import EngineConfig

    torch.set_num_threads(1)
    inst = GenerationInstance(rank, EngineConfig(device="cpu", kv_cache_tokens=kv_cache_tokens), model_dir, [0])
    inst.trainers = [LocalRRef(sink)]
    return WorkerHandle(rank, "generation", LocalRRef(inst))


def _requests(n, prompt_len=PROMPT):
    return [Request(i, torch.arange(prompt_len) % 250 + 3, 8, 8, group_id=i) for i in range(n)]  # 8 tokens, forced


def _need():
    """What the start check records for a train split whose longest prompt is 300 tokens."""
    need = ContextNeed(1008, 8)
    items = [TaskPrompt("a " * n, "", "t") for n in (20, PROMPT, 5)]
    fitting_prompts(items, lambda it: [0] * len(it.prompt.split()), 1008, "train", "error", need=need)
    return need


def _sgs():
    return SGS(make_dispatcher("round_robin"), lambda it: set())


def test_without_the_check_a_smaller_joiner_fails_the_round_or_cuts_outputs(tiny_model):  # noqa: F811
    """What happened before the check: the SGS took any joiner."""
    sink = SinkTrainer()
    sgs = _sgs()
    sgs.add(_instance(1, 1024, tiny_model, sink))
    sgs.add(_instance(3, 256, tiny_model, sink))
    too_long = r"(?s)rank 3 .*prompt of 300 tokens does not fit the context: max_model_len 240"
    with pytest.raises(WorkerFailed, match=too_long) as e:
        sgs.generate(1, _requests(4), 0).wait()
    assert not e.value.lost  # an exception, not a loss: no re-dispatch, the run stops
    # a joiner the prompt fits, but not prompt + max_tokens: its outputs are cut at 4 tokens, not 8
    sgs.remove(3)
    sgs.add(_instance(4, 320, tiny_model, sink))
    reports = sgs.generate(2, _requests(4), 0).wait()
    assert {r.rank: r.lengths for r in reports} == {1: [8, 8], 4: [4, 4]}


def test_a_joiner_with_less_context_than_the_kept_prompts_need_is_refused(tiny_model):  # noqa: F811
    need = _need()
    assert (need.longest, need.tokens) == (PROMPT, PROMPT + 8)
    sink = SinkTrainer()
    sgs = _sgs()
    sgs.add(_instance(1, 1024, tiny_model, sink))
    sgs.need = need
    for rank, kv, have in ((3, 256, 240), (4, 320, 304)):  # the prompt does not fit / its outputs would be cut
        h = _instance(rank, kv, tiny_model, sink)
        with pytest.raises(ContextTooSmall, match=rf"generation instance rank {rank} has max_model_len {have}, less "
                           r"than the 308 tokens .* task.prompts\('train'\)\[1\] .* is 300 tokens .* train.max_tokens "
                           r"8, within the starting instances' context of 1008"):
            sgs.add(h)
        assert not h.alive
    assert [h.rank for h in sgs.handles] == [1]
    joiner = _instance(5, 336, tiny_model, sink)  # 320 >= 308: serves every kept prompt in full
    sgs.add(joiner)
    reports = sgs.generate(1, _requests(4), 0).wait()
    assert {r.rank: r.lengths for r in reports} == {1: [8, 8], 5: [8, 8]}
    # the converse: the larger instance leaves (scale-in, or lost): the smaller one left serves it all
    sgs.remove(1, reason="left")
    reports = sgs.generate(2, _requests(4), 0).wait()
    assert [(r.rank, r.lengths) for r in reports] == [(5, [8, 8, 8, 8])]


def test_the_session_records_the_need_and_goes_on_without_a_refused_joiner(tiny_model, monkeypatch,  # noqa: F811
                                                                           capsys):
    from controller import joiners, session

    sink = SinkTrainer()
    sgs = _sgs()
    sgs.add(_instance(1, 1024, tiny_model, sink))
    s = session.Session.__new__(session.Session)
    s.cfg = SimpleNamespace(train=TrainSection(overlong_prompts="skip", max_tokens=8),
                            placement=SimpleNamespace(force_scale_out_at=1, rpc_timeout_s=1.0),
                            task=SimpleNamespace(name="t"))
    s.world = SimpleNamespace(sgs=sgs)
    s.args = SimpleNamespace(repl=False)
    s.tok = SimpleNamespace(encode_prompt=lambda text, messages=(): text.split(), chat_template="", tools=[])
    s.vocab_size = 0  # the check of token ids against the model's vocabulary: off here
    items = [TaskPrompt("a " * n, "", "t") for n in (20, 2000, PROMPT)]  # 2000 > 1008: dropped (skip)
    task = SimpleNamespace(prompts=lambda split: items)
    assert s._fitting_task(task).prompts("train") == [items[0], items[2]]
    assert (sgs.need.context, sgs.need.longest, sgs.need.tokens) == (1008, PROMPT, PROMPT + 8)
    # scale-out: joiner rank 3 (240) is refused and told to exit; rank 6 dies when asked; rank 5 (320) is added

    class Dying:
        def stats(self):
            raise RuntimeError("connection reset by peer")

    instances = {3: _instance(3, 256, tiny_model, sink), 5: _instance(5, 336, tiny_model, sink),
                 6: WorkerHandle(6, "generation", LocalRRef(Dying()))}

    def add_instance(world, cfg, rank, model_dir, eos_ids, version):
        world.sgs.add(instances[rank], None)
        return instances[rank]

    stopped, logged = [], []
    monkeypatch.setattr(joiners, "add_instance", add_instance)
    monkeypatch.setattr(joiners, "dismiss_joiner", lambda rank, code, reason: stopped.append(([rank], code)))
    s.waiting, s.joined, s.departed, s.want_add, s.policy = [3, 6, 5], [], [], False, None
    s.program = SimpleNamespace(version=0)
    s.model_dir, s.eos_ids = tiny_model, [0]
    s.metrics = SimpleNamespace(log_scalars=lambda d, i: logged.append((i, d)))
    joiners.admit(s, 1)
    assert stopped == [([3], 2)] and [h.rank for h in sgs.handles] == [1] and s.joined == [3] and s.departed == [3]
    assert "step 1: generation instance rank 3 has max_model_len 240" in capsys.readouterr().err
    joiners.admit(s, 2)
    assert "step 2: joiner rank 6 lost before it was added" in capsys.readouterr().err
    # told to exit too: one alive past a deadline held its engine, unlisted, until the job ended (review, s53)
    assert stopped == [([3], 2), ([6], 1)] and s.departed == [3, 6]
    joiners.admit(s, 3)
    assert [h.rank for h in sgs.handles] == [1, 5] and s.joined == [3, 6, 5] and stopped == [([3], 2), ([6], 1)]
    assert logged == []  # sgs/instances comes with each iteration's row (Metrics.log_iteration)


def _admit_failing(monkeypatch, error):
    """``joiners.admit`` of joiner rank 4 whose set-up raises ``error``: (the session, the
    dismissals told)."""
    from controller import joiners

    def add_instance(*a):
        raise error

    stopped = []
    monkeypatch.setattr(joiners, "add_instance", add_instance)
    monkeypatch.setattr(joiners, "dismiss_joiner", lambda rank, code, reason: stopped.append((rank, code, reason)))
    s = SimpleNamespace(cfg=SimpleNamespace(placement=SimpleNamespace(force_scale_out_at=1, rpc_timeout_s=1.0)),
                        waiting=[4], joined=[], departed=[], want_add=False, policy=None, world=None,
                        program=SimpleNamespace(version=0), model_dir="", eos_ids=[0])
    joiners.admit(s, 1)
    return s, stopped


def test_a_joiner_failing_while_being_set_up_is_dismissed_not_the_end_of_the_run(monkeypatch, capsys):
    """A joiner alive but raising in its set-up (its engine out of memory) ended a healthy run
    (exit 1); nothing depended on it yet."""
    from controller import joiners
    from controller.rpc import WorkerFailed

    s, stopped = _admit_failing(monkeypatch, WorkerFailed(4, "generation", "__init__",
                                                          "RuntimeError: CUDA out of memory"))
    assert stopped == [(4, 1, "not added: it failed while being set up (worker rank 4 (generation) raised in "
                              "__init__(): RuntimeError: CUDA out of memory)")] and s.departed == [4]  # why (s54)
    assert "joiner rank 4 not added, it failed while being set up" in capsys.readouterr().err

    # add_instance's None: lost, or alive past its set-up's deadline (world.add_instance): told to exit
    monkeypatch.setattr(joiners, "add_instance", lambda *a: None)
    s.waiting = [7]
    joiners.admit(s, 1)
    assert stopped[-1] == (7, 1, "not added: lost or timed out before it held the weights") and s.departed == [4, 7]

    def sender_fails(world, cfg, rank, model_dir, eos_ids, version):  # a trainer: the run's own failure
        raise WorkerFailed(2, "trainer", "push", "RuntimeError: boom")

    monkeypatch.setattr(joiners, "add_instance", sender_fails)
    s.waiting = [5]
    with pytest.raises(WorkerFailed, match="rank 2"):
        joiners.admit(s, 1)


def test_a_joiner_holding_another_model_is_refused_and_a_forced_add_waits_for_no_one_after_a_join(
        monkeypatch, capsys, tmp_path):
    """A joiner whose model.path held a deeper model was added (the pull covers the trainer's
    tensors, its extra layers stayed its own) and its samples trained; placement.force_scale_out_at
    waited up to 600 s for a joiner when the policy had added one already (review, s54)."""
    from controller import joiners
    from controller.world import ModelMismatch, model_signature
    from workers.model import ModelConfig

    def folder(name, **kw):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(ModelConfig(**kw).to_hf()))
        return str(d)

    run, deeper = folder("run"), folder("deeper", num_hidden_layers=5)
    longer, other_rope = folder("longer", max_position_embeddings=8192), folder("rope", rope_theta=1e6)
    assert model_signature(run) == model_signature(longer)  # the context is checked apart (ContextNeed)
    assert model_signature(run)["num_hidden_layers"] != model_signature(deeper)["num_hidden_layers"]
    assert model_signature(run)["rope_theta"] != model_signature(other_rope)["rope_theta"]
    # the same model spelled otherwise is the same (head_dim written out, default RoPE scaling
    # written, type / rope_type): a project-written folder was refused next to an HF download
    hf = ModelConfig().to_hf()
    del hf["head_dim"]
    (tmp_path / "spelled").mkdir()
    (tmp_path / "spelled" / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"rope_type": "default"}}))
    assert model_signature(str(tmp_path / "spelled")) == model_signature(run)
    linear = folder("linear", rope_scaling={"type": "linear", "factor": 2.0})
    both = folder("both", rope_scaling={"type": "linear", "rope_type": "linear", "factor": 2.0})
    assert model_signature(linear) == model_signature(both) != model_signature(run)

    def add_instance(world, cfg, rank, model_dir, eos_ids, version):
        raise ModelMismatch(f"joiner rank {rank}'s model folder m holds another model than this run's: "
                            "num_hidden_layers 5 (the run's: 4)")

    stopped = []
    monkeypatch.setattr(joiners, "add_instance", add_instance)
    monkeypatch.setattr(joiners, "dismiss_joiner", lambda rank, code, reason: stopped.append((rank, code, reason)))
    monkeypatch.setattr(joiners, "announced", lambda timeout_s=0.0: pytest.fail("waited") if timeout_s else [])
    s = SimpleNamespace(cfg=SimpleNamespace(placement=SimpleNamespace(force_scale_out_at=2, rpc_timeout_s=1.0)),
                        waiting=[3], joined=[], departed=[], want_add=True, policy=None, world=None,
                        program=SimpleNamespace(version=1), model_dir="", eos_ids=[0])
    joiners.admit(s, 1)  # the policy's add, before the forced one
    assert stopped == [(3, 2, "not added: joiner rank 3's model folder m holds another model than this run's: "
                              "num_hidden_layers 5 (the run's: 4)")] and s.departed == [3]
    assert "step 1: joiner rank 3's model folder m holds another model" in capsys.readouterr().err
    joiners.admit(s, 2)  # forced at 2: one came already (refused): not waited for again


def test_a_joiner_added_at_version_0_loads_the_weights_it_pulled(tiny_model):  # noqa: F811
    # an instance starts at version 0 with its folder's weights: hold_weights(0) returned at once,
    # and a joiner added at 0 generated from its own folder (review, s54)
    from controller.instance import GenerationInstance
    from workers.generation.config import EngineConfig

    inst = GenerationInstance(3, EngineConfig(device="cpu", kv_cache_tokens=1024), tiny_model, [0])
    params = dict(inst.engine.model.named_parameters())
    pulled = {n: torch.full_like(p, 0.01) for n, p in params.items()}
    inst.stage_weights(pulled, 0)
    assert inst.hold_weights(0) == 0
    assert all(torch.equal(p, pulled[n]) for n, p in inst.engine.model.named_parameters())


def test_a_joiner_without_the_model_folder_says_where_it_looked(tmp_path, monkeypatch):
    """A joiner started from another folder read a relative model.path from there: a bare
    FileNotFoundError (review, s56). It names the folder it resolved against now."""
    from controller.world import model_signature

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model.path 'runs/m': no config.json at .*runs/m/config.json \(a "
                                                r"relative model.path is read from this process's working directory"):
        model_signature("runs/m")


def test_a_joiner_is_told_the_error_not_torchs_frame(monkeypatch):
    """torch RPC's own form of a remote error ends with an "At:" block naming its frame: the
    joiner was told "(... internal.py(236): _handle_exception)" instead of why (review, s56)."""
    from controller.rpc import WorkerFailed

    torch_text = ("FileNotFoundError: On WorkerInfo(id=4, name=worker4):\nFileNotFoundError(2, 'No such file')\n"
                  "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    g()\n"
                  "FileNotFoundError: model.path 'runs/m': no config.json at /tmp/runs/m/config.json\n\n\nAt:\n"
                  "  /venv/torch/distributed/rpc/internal.py(236): _handle_exception\n")
    _, stopped = _admit_failing(monkeypatch, WorkerFailed(4, "generation", "model_signature", torch_text))
    assert stopped[0][2].endswith("FileNotFoundError: model.path 'runs/m': no config.json at /tmp/runs/m/config.json)")
