"""MultiTurnEngine (workers/generation/multi_turn.py) over the native engine and a tiny random
model: the environment's observations are spliced between the policy's turns, masked out, and
each continuation is exactly what a fresh engine generates from the whole context so far."""
import asyncio
import threading

import pytest
import torch

from workers.generation.config import EngineConfig
from workers.generation.engine import NativeEngine
from workers.generation.generate_all import generate_all
from workers.generation.multi_turn import MultiTurnEngine
from workers.generation.observations import cut_observation, observation_ids
from workers.model import CausalLM, ModelConfig, init_weights
from workers.tasks.envs import make_env
from workers.tokenizer import Tokenizer, train_bpe
from workers.types import Request, SamplingParams, TaskPrompt

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0)
TEXTS = ["what is the answer to the question", "obs one result: 7 and the tool said so", "the answer is 42"] * 30
SPECIAL = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
TOK = train_bpe(TEXTS, vocab_size=300, special_tokens=SPECIAL)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_TOK = Tokenizer(TOK.tok, eos_token=SPECIAL[0], pad_token=SPECIAL[1], chat_template=CHATML)
V = TOK.vocab_size
MODEL = init_weights(CausalLM(ModelConfig(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512)), seed=0, std=0.2).eval()
PROMPT = torch.tensor(TOK.encode("what is the answer"), dtype=torch.int64)
OBS = "obs one"
HALF = tuple(range(V // 2))  # half the vocabulary stops a turn: random turns end within a few tokens


def inner(eos) -> NativeEngine:
    return NativeEngine(EngineConfig(block_size=4, kv_cache_tokens=4096, max_batch_size=8, eos_ids=tuple(eos)),
                        model=MODEL)


def req(sid: int = 1, max_tokens: int = 40, prompt: torch.Tensor = PROMPT, task=None, group: int = 7) -> Request:
    return Request(sid, prompt, max_tokens, sampling=GREEDY, group_id=group, task=task)


def greedy(prompt: list[int], max_tokens: int, eos) -> tuple[list[int], list[float], str]:
    """A fresh engine's greedy generation: the reference a continuation must equal."""
    [s] = generate_all(inner(eos), [Request(0, torch.tensor(prompt), max_tokens, sampling=GREEDY)])
    return s.output_ids.tolist(), s.logprobs.tolist(), s.finish_reason


def first_stop() -> tuple[tuple[int], list[int]]:
    """An EOS id that ends the prompt's greedy first turn after a few tokens, and that turn."""
    out, _, _ = greedy(PROMPT.tolist(), 12, (SPECIAL.index("<|pad|>"),))
    i = next(i for i in range(2, len(out)) if out[i] not in out[:i])
    return (out[i],), out[:i + 1]


def two_stops() -> tuple[tuple[int, ...], list[int]]:
    """EOS ids that end both the first turn and the one after ``OBS`` within a few tokens."""
    eos, turn1 = first_stop()
    turn2, _, reason = greedy(PROMPT.tolist() + turn1 + TOK.encode(OBS), 12, eos)
    if reason == "stop":
        return eos, turn1
    j = next(j for j in range(1, len(turn2)) if turn2[j] not in turn1 and turn2[j] not in turn2[:j])
    return eos + (turn2[j],), turn1


class Script:
    """An environment answering turn k with ``answers[k - 1]`` (an exception is raised); it
    records the conversations it was handed."""

    def __init__(self, *answers):
        self.answers, self.calls = answers, []

    def __call__(self, task, messages):
        self.calls.append((task, messages))
        turn = sum(m["role"] == "assistant" for m in messages)
        answer = self.answers[turn - 1] if turn <= len(self.answers) else None
        if isinstance(answer, Exception):
            raise answer
        return answer


def wrap(eos, env, tok=TOK, **kw) -> MultiTurnEngine:
    return MultiTurnEngine(inner(eos), tok, env, "script", **kw)


def run(eng: MultiTurnEngine, requests, max_steps: int = 2000) -> list:
    refused = eng.add(requests)
    assert not refused, refused[0].error
    return run_on(eng, max_steps)


def test_two_turns_are_turn_observation_turn_and_the_continuation_is_a_fresh_engines():
    eos, turn1 = two_stops()
    env = Script(OBS, None)
    eng = wrap(eos, env)
    [s] = run(eng, [req(max_tokens=40)])
    obs = TOK.encode(OBS)
    n1, no = len(turn1), len(obs)
    out = s.output_ids.tolist()
    assert out[:n1] == turn1 and out[n1:n1 + no] == obs
    turn2, lp2, reason = greedy(PROMPT.tolist() + turn1 + obs, 40 - n1 - no, eos)
    assert out[n1 + no:] == turn2 and s.finish_reason == reason == "stop"
    assert s.loss_mask.tolist() == [True] * n1 + [False] * no + [True] * len(turn2)
    assert s.logprobs[n1:n1 + no].tolist() == [0.0] * no
    _, lp1, _ = greedy(PROMPT.tolist(), n1, eos)
    torch.testing.assert_close(s.logprobs[:n1], torch.tensor(lp1))
    torch.testing.assert_close(s.logprobs[n1 + no:], torch.tensor(lp2))
    assert s.turns == 2 and s.sample_id == 1 and s.group_id == 7 and torch.equal(s.prompt_ids, PROMPT)
    assert set(s.timings) >= {"queued", "admitted", "first_token", "finished"}
    # the conversation handed over: the prompt (decoded: no task), the turns, the observation
    _, first = env.calls[0]
    assert first == [{"role": "user", "content": TOK.decode(PROMPT)},
                     {"role": "assistant", "content": TOK.decode(turn1)}]
    assert env.calls[1][1][2:] == [{"role": "tool", "content": OBS},
                                   {"role": "assistant", "content": TOK.decode(turn2)}]
    assert not eng.has_work() and not eng._traj


def test_the_task_and_its_chat_are_what_the_environment_sees():
    env = Script(None)
    item = TaskPrompt("q?", "42", "t", messages=({"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "q?"}))
    [s] = run(wrap(HALF, env), [req(task=item)])
    task, messages = env.calls[0]
    assert task is item and messages[:2] == list(item.messages) and messages[2]["role"] == "assistant"
    assert s.turns == 1 and s.finish_reason == "stop" and s.loss_mask.all()


def test_the_budget_covers_every_turn_and_observation():
    eos, turn1 = first_stop()
    obs = "obs one result: 7"
    ids = TOK.encode(obs)
    # room for the observation and one generated token: both go in, and the budget ends it
    [s] = run(wrap(eos, Script(obs, None)), [req(max_tokens=len(turn1) + len(ids) + 1)])
    assert len(s.output_ids) == len(turn1) + len(ids) + 1 and s.finish_reason == "length" and s.turns == 2
    assert s.output_ids[len(turn1):-1].tolist() == ids
    assert s.loss_mask.tolist() == [True] * len(turn1) + [False] * len(ids) + [True]
    # no room for a generated token after it: the trajectory ends before it, as verl's agent loop
    # does (an observation cut to fit would lose the template's next generation prompt)
    [s] = run(wrap(eos, Script(obs, None)), [req(max_tokens=len(turn1) + len(ids))])
    assert s.output_ids.tolist() == turn1 and s.finish_reason == "length" and s.turns == 1


LONG = "obs one result: 7 and the tool said so the answer is 42"


@pytest.mark.parametrize("side", ["left", "middle", "right"])
def test_a_long_observation_is_cut_as_verl_cuts_a_tool_response(side):
    ids = TOK.encode(LONG, add_special_tokens=False)
    text = cut_observation(TOK, LONG, 4, side)
    marker = {"left": "...(truncated)", "right": "(truncated)...", "middle": "...(truncated)..."}[side]
    kept = {"left": (ids[:4], []), "right": ([], ids[-4:]), "middle": (ids[:2], ids[-2:])}[side]
    assert text == TOK.decode(kept[0], skip_special_tokens=False) + marker + TOK.decode(kept[1], skip_special_tokens=False)
    assert cut_observation(TOK, LONG, len(ids), side) == LONG  # it fits: as is
    eos, turn1 = first_stop()
    [s] = run(wrap(eos, Script(LONG, None), max_observation_tokens=4, truncate_side=side), [req(max_tokens=80)])
    assert s.output_ids[len(turn1):len(turn1) + len(TOK.encode(text))].tolist() == TOK.encode(text)


def test_the_cut_is_on_the_content_so_the_generation_prompt_stays():
    eos, turn1 = first_stop()
    env = Script(LONG, None)
    [s] = run(wrap(eos, env, tok=CHAT_TOK, max_observation_tokens=3), [req(max_tokens=120)])
    obs = observation_ids(CHAT_TOK, {"role": "tool", "content": cut_observation(TOK, LONG, 3, "middle")})
    assert s.output_ids[len(turn1):len(turn1) + len(obs)].tolist() == obs
    assert TOK.decode(obs, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert s.turns == 2 and env.calls[0][1][-1]["role"] == "assistant"


def test_a_narrow_integer_prompt_takes_any_ids_after_it():
    # the engines take uint8 .. int64 prompts; a continuation holds generated and observation ids
    # past a uint8's range (it was built in the prompt's dtype: an overflow error mid-step)
    prompt = torch.tensor([5, 17, 42, 99, 120, 7], dtype=torch.uint8)
    [s] = run(wrap(HALF, Script(OBS, None)), [req(prompt=prompt)])
    assert s.turns == 2 and s.output_ids.max() >= 256 and s.prompt_ids.dtype == torch.uint8


def test_max_turns_stops_the_conversation():
    env = Script(OBS, OBS, OBS, OBS)
    [s] = run(wrap(HALF, env, max_turns=2), [req(max_tokens=200)])
    assert s.turns == 2 and len(env.calls) == 1 and s.finish_reason == "stop"
    assert (~s.loss_mask).sum() == len(TOK.encode(OBS))


def test_many_trajectories_at_once_keep_their_ids():
    env = Script(OBS, None)
    reqs = [req(sid, max_tokens=30, prompt=torch.tensor(TOK.encode(t)), group=sid) for sid, t in
            enumerate(["what is", "the answer", "to the question", "obs one"])]
    out = run(wrap(HALF, env, workers=2), reqs)
    assert sorted(s.sample_id for s in out) == [0, 1, 2, 3]
    for s in out:
        assert s.loss_mask is not None and len(s.loss_mask) == len(s.output_ids) == len(s.logprobs)


@pytest.mark.parametrize("answer,why", [(RuntimeError("tool crashed"), "RuntimeError: tool crashed"),
                                        (42, "TypeError: returned a int")])
def test_an_environment_that_fails_is_the_samples_error(answer, why):
    eng = wrap(HALF, Script(answer))
    [s] = run(eng, [req()])
    assert s.finish_reason == "error" and s.sample_id == 1
    assert "multi_turn.env: 'script'" in s.error and "sample 1 after turn 1" in s.error and why in s.error
    assert not eng.has_work()


def test_a_dict_observation_is_used_as_is():
    eos, turn1 = first_stop()
    user = {"role": "user", "content": OBS}
    env = Script(user, None)
    [s] = run(wrap(eos, env, tok=CHAT_TOK), [req(max_tokens=60)])
    obs = CHAT_TOK.encode(f"<|im_start|>user\n{OBS}<|im_end|>\n<|im_start|>assistant\n")
    assert s.output_ids[len(turn1):len(turn1) + len(obs)].tolist() == obs


def test_a_chat_template_renders_the_observation_as_its_tool_turn_and_the_next_generation_prompt():
    msg = {"role": "tool", "content": OBS}
    text = "<|im_start|>tool\nobs one<|im_end|>\n<|im_start|>assistant\n"
    assert observation_ids(CHAT_TOK, msg) == CHAT_TOK.encode(text)
    assert TOK.decode(observation_ids(CHAT_TOK, msg), skip_special_tokens=False) == text
    assert observation_ids(TOK, msg) == TOK.encode(OBS)  # no template: the content as is
    counting = Tokenizer(TOK.tok, eos_token=SPECIAL[0], chat_template="{{ messages | length }}" + CHATML)
    with pytest.raises(ValueError, match="chat template"):
        observation_ids(counting, msg)
    eos, turn1 = first_stop()
    [s] = run(wrap(eos, Script(OBS, None), tok=CHAT_TOK), [req(max_tokens=60)])
    n = len(CHAT_TOK.encode(text))
    assert s.output_ids[len(turn1):len(turn1) + n].tolist() == CHAT_TOK.encode(text)
    [s] = run(wrap(eos, Script(OBS, None), tok=counting), [req(max_tokens=60)])
    assert s.finish_reason == "error" and "multi_turn.env" in s.error and "chat template" in s.error


def test_abort_mid_trajectory_leaves_nothing_behind():
    eos, _ = first_stop()
    gate, called = threading.Event(), threading.Event()

    def slow(task, messages):
        called.set()
        gate.wait(10)
        return OBS

    eng = wrap(eos, slow)
    eng.add([req(1), req(2, prompt=torch.tensor(TOK.encode("the answer is")), group=8)])
    for _ in range(200):
        if called.is_set():
            break
        eng.step()
    assert called.is_set()
    waiting = [sid for sid, t in eng._traj.items() if t.env_call is not None]
    assert eng.abort([99, *waiting]) == waiting  # unknown ids are ignored
    gate.set()
    assert eng.abort([1, 2, 1]) == [sid for sid in (1, 2) if sid not in waiting]
    assert not eng.has_work() and eng.step() == [] and not eng._traj
    # a continuation in the engine: aborted there
    eng = wrap(eos, Script(OBS, None))
    eng.add([req(1)])
    _past_first_turn(eng, 1)
    assert eng.inner.has_work() and eng.abort([1]) == [1]
    assert not eng.has_work() and not eng.inner.has_work() and eng.inner.stats().kv_blocks_used == 0
    eng.close()


def test_load_weights_restarts_trajectories_past_their_first_turn():
    eos, turn1 = two_stops()
    [ref] = run(wrap(eos, Script(OBS, None)), [req()])
    env = Script(OBS, None)
    eng = wrap(eos, env)
    eng.add([req()])
    _past_first_turn(eng, 1)
    eng.load_weights(MODEL.hf_state_dict().items(), version=1)  # the same weights: the same outputs
    assert eng._traj[1].turns == 0 and not eng._traj[1].output
    out = []
    while eng.has_work():
        out += eng.step()
    [s] = out
    assert s.weight_version == 1 and torch.equal(s.output_ids, ref.output_ids) and s.turns == ref.turns
    assert ref.turns == 2 and len(env.calls) == 3  # turn 1 was answered twice


def test_a_live_id_is_refused_and_an_engine_refusal_passes_through():
    eng = wrap(HALF, Script(None))
    eng.add([req(1)])
    [dup] = eng.add([req(1)])
    assert dup.finish_reason == "error" and "already" in dup.error
    [bad] = eng.add([req(2, max_tokens=0)])
    assert bad.finish_reason == "error" and bad.sample_id == 2 and 2 not in eng._traj


def test_an_async_environment_is_run_to_its_end_on_one_event_loop():
    eos, turn1 = two_stops()
    [ref] = run(wrap(eos, Script(OBS, None)), [req()])
    loops, calls = set(), []

    async def env(task, messages):  # as verl's tools: async def
        await asyncio.sleep(0.01)
        loops.add(asyncio.get_running_loop())
        calls.append(messages)
        return OBS if len(calls) == 1 else None

    [s] = run(wrap(eos, env), [req()])
    assert torch.equal(s.output_ids, ref.output_ids) and torch.equal(s.loss_mask, ref.loss_mask)
    assert s.turns == ref.turns == 2 and len(calls) == 2
    # every call on the one loop: a client the env made once (bound to its loop) keeps working
    assert len(loops) == 1

    async def failing(task, messages):
        raise RuntimeError("tool crashed")

    [s] = run(wrap(HALF, failing), [req()])
    assert s.finish_reason == "error" and "multi_turn.env: 'script'" in s.error
    assert "RuntimeError: tool crashed" in s.error


def test_a_class_environment_is_built_once_and_its_instance_called(tmp_path):
    (tmp_path / "envs.py").write_text(
        "import asyncio\n\n\n"
        "class Env:\n"
        "    built = 0\n\n"
        "    def __init__(self):\n"
        "        Env.built += 1\n"
        "        self.calls = []\n\n"
        "    def __call__(self, task, messages):\n"
        "        self.calls.append(messages)\n"
        f"        return {OBS!r} if len(messages) == 2 else None\n\n\n"
        "class AsyncEnv(Env):\n"
        "    async def __call__(self, task, messages):\n"
        "        await asyncio.sleep(0)\n"
        "        return Env.__call__(self, task, messages)\n\n\n"
        "class NotCallable:\n"
        "    pass\n")
    eos, _ = two_stops()
    [ref] = run(wrap(eos, Script(OBS, None)), [req()])
    for name in ("Env", "AsyncEnv"):
        env = make_env(f"{tmp_path / 'envs.py'}:{name}")
        assert type(env).__name__ == name and type(env).built == (1 if name == "Env" else 2)
        reqs = [req(1), req(2, group=8)]
        out = run(wrap(eos, env), reqs)
        assert len(out) == 2 and all(torch.equal(s.output_ids, ref.output_ids) and s.turns == 2 for s in out)
        assert len(env.calls) == 4 and type(env).built == (1 if name == "Env" else 2)  # one instance, 4 calls
    with pytest.raises(ValueError, match="multi_turn.env: .* is a class without __call__"):
        make_env(f"{tmp_path / 'envs.py'}:NotCallable")
    (tmp_path / "needs.py").write_text("class Env:\n    def __init__(self, url):\n        pass\n\n"
                                       "    def __call__(self, task, messages):\n        return None\n")
    with pytest.raises(ValueError, match=r"multi_turn.env: building .* failed \(TypeError"):
        make_env(f"{tmp_path / 'needs.py'}:Env")


def test_each_turn_draws_with_its_own_seed():
    from workers.generation.trajectory import turn_sampling

    s = SamplingParams(temperature=1.0, seed=5)
    seeds = [turn_sampling(s, k).seed for k in (1, 2, 3)]
    assert len(set(seeds + [5])) == 4 and all(0 <= x < 1 << 63 for x in seeds)
    assert [turn_sampling(s, k).seed for k in (1, 2, 3)] == seeds  # reproducible
    assert turn_sampling(SamplingParams(seed=6), 1).seed not in seeds  # other requests' seeds differ
    assert turn_sampling(SamplingParams(), 2).seed is None  # unseeded stays unseeded


def test_a_failing_inner_step_keeps_the_trajectories_already_done():
    """A trajectory the environment ended comes out of the step that collects its answer; if the
    inner engine's step raises in that same call, it comes out of the next one, not lost."""
    import concurrent.futures as cf

    eng = wrap(HALF, Script(None))
    assert eng.add([req(1)]) == []
    while not eng._waiting:
        assert eng.step() == []
    cf.wait([t.env_call for t in eng._waiting.values()])  # its answer (done) is in
    assert eng.add([req(2)]) == []  # the inner engine has work, so step() steps it
    real, calls = eng.inner.step, []

    def boom():
        calls.append(1)
        raise RuntimeError("forward failed")

    eng.inner.step = boom
    with pytest.raises(RuntimeError, match="forward failed"):
        eng.step()
    eng.inner.step = real
    assert calls and eng.has_work()
    out = run_on(eng)
    assert sorted(s.sample_id for s in out) == [1, 2] and all(s.finish_reason != "error" for s in out)


def _past_first_turn(eng: MultiTurnEngine, sid: int) -> None:
    """Step until ``sid``'s second turn is in the inner engine (its first answered)."""
    for _ in range(200):
        t = eng._traj.get(sid)
        if t is not None and t.turns == 1 and t.env_call is None:
            return
        eng.step()
    raise AssertionError(f"sample {sid} never got past its first turn")


def run_on(eng: MultiTurnEngine, max_steps: int = 2000) -> list:
    out = []
    for _ in range(max_steps):
        if not eng.has_work():
            return out
        out += eng.step()
    raise AssertionError("still has work")
