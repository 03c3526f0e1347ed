"""MultiTurnEngine: multi-turn rollouts (verl's ``rollout.multi_turn``: tool calls, agent loops)
around any engine (native or vLLM), with the ``Engine`` Protocol's methods.

A trajectory is one request's conversation. Each assistant turn is a request of the inner
engine; a turn that ends in EOS (``"stop"``) with turns and output budget left is handed to the
environment (``multi_turn.env``, ``workers/tasks/envs``) on a thread pool, and its observation,
tokenised as the chat template renders it (``observation_ids``), is spliced in: the next turn is
a continuation request of the same ``sample_id`` whose prompt is the original prompt, every turn
and observation so far. What comes out is ONE Sample per trajectory: ``output_ids`` is every
turn and observation concatenated, ``loss_mask`` is False on the observation tokens (their
logprobs 0.0), ``turns`` counts the assistant turns, ``env_rewards`` the rewards the
environment gave (a dict answer's ``reward``: the trainer adds their sum to the task's score).
``max_tokens`` (``train.max_tokens``, as
verl's ``response_length``) covers all turns and observations.

A continuation is a new request over the whole context (group_id -1); the engine's prefix
cache (``engine.prefix_caching``) finds its full blocks, so a turn computes its new tokens and
one partial block. Each turn's seed is the request's mixed with the turn (``turn_sampling``).
Weights loaded mid-trajectory restart it from the original request (a sample never mixes weight
versions)."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from workers.generation.observations import cut_observation, observation_ids, observation_message
from workers.generation.request_check import sample_id_problem
from workers.generation.sequence import error_sample
from workers.generation.trajectory import Trajectory, turn_sampling
from workers.tasks.envs import takes_trajectory
from workers.tasks.scoring import resolve
from workers.types import EngineStats, Request, Sample, TaskPrompt

# an environment: (the dataset item, the conversation so far in OpenAI format) -> the observation
# (a str: a tool message; a {"role", "content"} dict, whose optional "reward" is the turn's and
# "done": true ends the trajectory; None: done), or an awaitable of one (an ``async def``
# environment: awaited on the pool thread)
Env = Callable[[TaskPrompt | None, list[dict]], "str | dict | None"]
log = logging.getLogger("streamrl.multi_turn")
WAIT_S = 0.05  # the longest step() waits for an environment call when the engine is idle


@dataclass
class _Observation:
    """What an environment call gave: a message and its tokens, None (done), or an error; and
    the reward of the turn, if it gave one."""

    message: dict | None = None
    ids: list[int] = field(default_factory=list)
    error: str = ""
    reward: float | None = None


class MultiTurnEngine:
    """``MultiTurnEngine(inner, tokenizer, env, spec)``: ``inner`` any Engine; ``env`` the
    environment callable, sync or ``async def`` (``spec``: its ``multi_turn.env`` name, for
    errors); ``max_turns`` assistant turns; an observation's content cut to
    ``max_observation_tokens`` on ``truncate_side`` (``cut_observation``); ``workers``
    environment calls at once."""

    def __init__(self, inner, tokenizer, env: Env, spec: str = "", max_turns: int = 4,
                 max_observation_tokens: int = 256, workers: int = 4, truncate_side: str = "middle"):
        self.inner, self.tokenizer, self.env, self.spec = inner, tokenizer, env, spec
        self.max_turns, self.max_observation_tokens = max_turns, max_observation_tokens
        self.truncate_side = truncate_side
        self.pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="multi_turn_env")
        self._start, self._end = getattr(env, "start", None), getattr(env, "end", None)  # per-trajectory hooks
        self._ends: list[tuple[cf.Future, str]] = []  # ``end`` calls not done (close runs the queued ones)
        # (submitted from the engine's thread and the pool's callbacks; held by close() over the pool's
        # shutdown, so an end submitted before it is one close() finds)
        self._ends_lock = threading.RLock()
        self._takes_id = takes_trajectory(env)
        self._traj: dict[int, Trajectory] = {}  # sample_id -> its trajectory (in the engine or the env)
        self._waiting: dict[int, Trajectory] = {}  # those waiting on an environment call, in call order
        self._ready: list[Sample] = []  # finished between steps (restarts refused), returned by the next
        self._readd: list[Request] = []  # next turns whose add() raised (aborted there): added next step
        self._serials = itertools.count()  # Trajectory.serial

    def __repr__(self) -> str:
        return f"MultiTurnEngine({self.inner!r}, env {self.spec!r}, max_turns {self.max_turns})"

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def weight_dtype(self):
        return getattr(self.inner, "weight_dtype", None)

    # ---- requests ------------------------------------------------------------------------
    def add(self, requests: Sequence[Request]) -> list[Sample]:
        """Start a trajectory per request (its first turn queued in the inner engine); refusals
        are the inner engine's error samples (an id whose trajectory is live: ours)."""
        refused, accepted = [], []
        for r in requests:
            if (why := sample_id_problem(r.sample_id)) is not None:  # (it keys the trajectories)
                refused.append(error_sample(r, why, self.inner.stats().weight_version))
                continue
            if r.sample_id in self._traj:  # (waiting on the environment, the inner engine does not know it)
                refused.append(error_sample(r, f"sample_id {r.sample_id} is already queued or running",
                                            self.inner.stats().weight_version))
                continue
            try:  # (a request whose prompt ids cannot be decoded: its error, not the batch's)
                messages = self._prompt_messages(r)
            except Exception as e:  # noqa: BLE001 - refused as the Engine Protocol refuses bad input
                refused.append(error_sample(r, f"its prompt cannot be read ({type(e).__name__}: {e})",
                                            self.inner.stats().weight_version))
                continue
            self._traj[r.sample_id] = Trajectory(r, messages, serial=next(self._serials))
            accepted.append(r)
        for s in self.inner.add(accepted):
            self._retire(s.sample_id)
            refused.append(s)
        return refused

    def _prompt_messages(self, r: Request) -> list[dict]:
        task = r.task
        if task is not None and task.messages:
            return [dict(m) for m in task.messages]
        text = task.prompt if task is not None else self.tokenizer.decode(r.prompt_ids, skip_special_tokens=True)
        return [{"role": "user", "content": text}]

    def has_work(self) -> bool:
        return bool(self._ready) or bool(self._readd) or bool(self._waiting) or self.inner.has_work()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Sample]:
        out, self._ready = self._ready, []
        try:
            self._step(out)
        except BaseException:  # the trajectories already done (in ``out``) come out of the next step
            self._ready = out + self._ready
            raise
        return out

    def _step(self, out: list[Sample]) -> None:
        """One step; each sample finished goes to ``out`` as it is (a later failure keeps it)."""
        self._collect(out)
        if not self.inner.has_work() and self._waiting and not out:  # idle: wait, no busy spin
            cf.wait([t.env_call for t in self._waiting.values()], timeout=WAIT_S, return_when=cf.FIRST_COMPLETED)
            self._collect(out)
        if not self.inner.has_work():
            return
        finished = self.inner.step()
        for s in finished:
            t = self._traj.get(s.sample_id)
            if t is None:  # (not ours: passed through)
                out.append(s)
                continue
            if s.finish_reason == "error":  # as the trajectory's own request: a continuation's group
                self._retire(s.sample_id)  # is -1 and its prompt the context so far (review, s53)
                out.append(error_sample(t.request, s.error, s.weight_version))
                continue
            t.absorb(s)
            if s.finish_reason == "stop" and t.turns < self.max_turns and self._room(t) > 0:
                self._call_env(t, s.output_ids)
            else:
                self._retire(s.sample_id)
                out.append(t.sample(s.finish_reason))

    def _room(self, t: Trajectory) -> int:
        """Output tokens left to ``t``: its budget, and the engine's context."""
        r = t.request
        return min(r.max_tokens, self.inner.max_model_len - len(r.prompt_ids)) - len(t.output)

    def _call_env(self, t: Trajectory, turn_ids: torch.Tensor) -> None:
        t.messages.append({"role": "assistant",
                           "content": self.tokenizer.decode(turn_ids, skip_special_tokens=True)})
        t.env_call = self.pool.submit(self._observe, t, [dict(m) for m in t.messages], t.turns)
        self._waiting[t.request.sample_id] = t

    def _observe(self, t: Trajectory, messages: list[dict], turn: int) -> _Observation:
        """The environment's answer to a conversation, tokenised (on a pool thread); before the
        trajectory's first call (after its first turn), the environment's ``start`` (``t.opened``
        once it returned)."""
        task, sample_id, tid = t.request.task, t.request.sample_id, t.tid
        what = "start() failed"
        try:
            # an async env's coroutine runs to its end on the process's one event loop (as async
            # rewards do): a client it keeps stays bound to that loop
            if turn == 1 and self._start is not None:
                resolve(self._start(tid, task))
                t.opened = True
            what = "failed"
            kw = {"trajectory": tid} if self._takes_id else {}
            message, reward = observation_message(resolve(self.env(task, messages, **kw)))
        except BaseException as e:  # noqa: BLE001 - your environment's failure (an argparse's
            # SystemExit too, which stopped the engine's step): the sample's error
            return _Observation(error=f"multi_turn.env: {self.spec!r} {what} on sample {sample_id} after turn "
                                      f"{turn} ({type(e).__name__}: {e})")
        if message is None:
            return _Observation(reward=reward)
        try:
            message = {**message, "content": cut_observation(self.tokenizer, message["content"],
                                                             self.max_observation_tokens, self.truncate_side)}
            return _Observation(message, observation_ids(self.tokenizer, message), reward=reward)
        except BaseException as e:  # noqa: BLE001 - a template that cannot render it
            return _Observation(error=f"multi_turn.env: {self.spec!r}: the observation of sample {sample_id} after "
                                      f"turn {turn} could not be tokenised ({type(e).__name__}: {e})")

    def _collect(self, out: list[Sample]) -> None:
        """Take the environment answers that are in: each ends its trajectory (its sample to
        ``out``) or becomes the next turn's request (added to the inner engine in one call, with
        those a failed add left)."""
        continuations, self._readd = self._readd, []
        for sid, t in list(self._waiting.items()):
            if not t.env_call.done():
                continue
            del self._waiting[sid]
            if t.env_call.cancelled():  # close() cancelled it: the trajectory is gone
                self._retire(sid)
                continue
            obs, t.env_call = t.env_call.result(), None
            if obs.error:
                self._retire(sid)
                out.append(error_sample(t.request, obs.error, t.weight_version))
                continue
            if obs.reward is not None:  # (the turn's, also when the trajectory ends here)
                t.env_rewards.append(obs.reward)
            if obs.message is None:  # done: the last turn ended in EOS
                self._retire(sid)
                out.append(t.sample("stop"))
                continue
            ids = obs.ids
            if len(ids) >= self._room(t):  # no room for it and a generated token: done (as verl)
                self._retire(sid)
                out.append(t.sample("length"))
                continue
            t.messages.append(obs.message)
            t.output += ids
            t.logprobs += [0.0] * len(ids)
            t.mask += [False] * len(ids)
            continuations.append(self._continuation(t))
        if continuations:
            try:
                refused = self.inner.add(continuations)
            except BaseException:  # queued or not (vLLM's add queues, then raises): none is, added next step
                self.inner.abort([r.sample_id for r in continuations])
                self._readd = continuations
                raise
            for s in refused:
                t = self._traj.get(s.sample_id)
                self._retire(s.sample_id)
                out.append(s if t is None else error_sample(t.request, s.error, s.weight_version))

    def _retire(self, sid: int) -> None:
        """``sid``'s trajectory is over (out, refused, aborted, restarted): forgotten, and the
        environment's ``end`` asked for on the pool when its ``start`` returned; with a call in
        flight, decided once that call is over (the two never overlap; a call cancelled before
        it ran never started the trajectory)."""
        t = self._traj.pop(sid, None)
        if t is None or self._end is None:
            return
        if t.env_call is not None and not t.env_call.done():
            t.env_call.add_done_callback(lambda _: self._submit_end(t))
        else:
            self._submit_end(t)

    def _submit_end(self, t: Trajectory) -> None:
        if not t.opened:  # it never called the environment, or its start was cancelled or raised
            return
        with self._ends_lock:  # queued and listed at once: close() cancels it with the pool, then runs it
            try:
                f = self.pool.submit(self._run_end, t.tid)
            except RuntimeError:  # the pool is shut down (close): end it here
                f = None
            else:
                self._ends = [e for e in self._ends if not e[0].done()] + [(f, t.tid)]
        if f is None:
            self._run_end(t.tid)

    def _run_end(self, tid: str) -> None:
        try:
            resolve(self._end(tid))
        except BaseException as e:  # noqa: BLE001 - the sample is out already: said, not raised
            log.warning("multi_turn.env: %r end(%r) failed (%s: %s)", self.spec, tid, type(e).__name__, e)

    def _continuation(self, t: Trajectory) -> Request:
        r = t.request
        # int64: a prompt may come in a narrower integer dtype than the ids generated after it
        prompt = torch.cat([r.prompt_ids.cpu().long(), torch.tensor(t.output, dtype=torch.int64)])
        return dataclasses.replace(r, prompt_ids=prompt, max_tokens=r.max_tokens - len(t.output), min_tokens=0,
                                   group_id=-1, sampling=turn_sampling(r.sampling, t.turns))

    # ---- control -------------------------------------------------------------------------
    def abort(self, sample_ids: Iterable[int]) -> list[int]:
        """Drop the trajectories (an environment call's answer is ignored when it comes), their
        turns in the inner engine, and their samples finished but not yet returned (no sample
        of them comes out of a later step()); the ids aborted, in the order given."""
        aborted, in_engine = [], []
        ids = [sid for sid in sample_ids if sample_id_problem(sid) is None]  # (add refused the others)
        gone = set(ids)
        self._readd = [r for r in self._readd if r.sample_id not in gone]  # (not in the inner engine)
        done = {s.sample_id for s in self._ready} & set(ids)
        self._ready = [s for s in self._ready if s.sample_id not in done]
        for sid in ids:
            if sid in done:
                aborted.append(sid)
                continue
            t = self._traj.get(sid)
            if t is None:
                continue
            aborted.append(sid)
            if self._waiting.pop(sid, None) is not None:
                t.env_call.cancel()  # (one already running finishes; nothing reads it)
            else:
                in_engine.append(sid)
            self._retire(sid)
        self.inner.abort(in_engine)
        return aborted

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     version: int) -> None:
        """The inner engine's (its turns in flight restart); trajectories past their first turn
        restart from the original request, their turns so far being of the old weights."""
        self.inner.load_weights(named_tensors, version)
        restart = [t for t in self._traj.values() if t.turns > 0]
        self._readd = []  # (past their first turn: restarted below)
        self.inner.abort([t.request.sample_id for t in restart if t.env_call is None])
        for t in restart:
            sid = t.request.sample_id
            if self._waiting.pop(sid, None) is not None:
                t.env_call.cancel()
            self._retire(sid)
            self._traj[sid] = Trajectory(t.request, self._prompt_messages(t.request), serial=next(self._serials))
        for s in self.inner.add([t.request for t in restart]):
            self._retire(s.sample_id)
            self._ready.append(s)

    def set_max_batch_size(self, n: int) -> None:
        self.inner.set_max_batch_size(n)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def close(self) -> None:
        """Pending environment calls are cancelled; the trajectories the environment started get
        their ``end`` (here, after the pool: a running call may still be finishing)."""
        with self._ends_lock:
            self.pool.shutdown(wait=False, cancel_futures=True)
        for sid in list(self._traj):
            self._retire(sid)
        with self._ends_lock:
            ends, self._ends = self._ends, []
        for f, tid in ends:  # queued behind other calls, cancelled with them: run here
            if f.cancelled():
                self._run_end(tid)
        self.inner.close()
