"""NativeEngine: the project's own generation engine (Engine Protocol).

Continuous batching over a paged KV cache (``Scheduler``, ``BlockManager``), prefix sharing
for GRPO groups (``PrefixCache``), automatic prefix caching of full blocks by hash
(``BlockManager``), per-request sampling (``Sampler``), streaming of finished
samples from ``step()``, weights replaced in place with a version label.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Iterable, Mapping, Sequence as Seq

import torch

from workers.generation import kernels_package
from workers.generation.admission import admission_key
from workers.generation.block_manager import NEVER_REGISTER, BlockManager
from workers.generation.config import EngineConfig, engine_context
from workers.generation.held_interrupt import HeldInterrupt
from workers.generation.model_runner import ModelRunner
from workers.generation.prefix_cache import PrefixCache
from workers.generation.request_check import (TIED, check_batch_cap, check_eos_ids, check_requests, check_tied,
                                              check_weights, hashable, refusal)
from workers.generation.scheduler import Scheduler
from workers.generation.token_rate import TokenRate
from workers.generation.sequence import Sequence, Status, error_sample
from workers.model import CausalLM, default_dtype, load_pretrained, on_device, resolve_device
from workers.types import EngineStats, Request, Sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cpu_half_in_fp32(mode: str) -> bool:
    """Whether bf16/fp16 weights compute in fp32 on this CPU (see EngineConfig.cpu_half_compute)."""
    if mode != "auto":
        return mode == "float32"
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
        getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return not native


def resolve_attention_backend(cfg: EngineConfig, device: torch.device) -> str:
    """``attention_backend`` "auto": the Triton decode kernel (with CUDA-graph decode) on CUDA
    where it applies, else the portable torch path."""
    if cfg.attention_backend != "auto":
        return cfg.attention_backend
    if device.type != "cuda" or cfg.kv_cache_dtype != "auto" or cfg.block_size % 16:
        return "torch"
    return "triton" if kernels_package.load().triton_usable(device) else "torch"


class NativeEngine:
    """``NativeEngine(cfg, model_dir)`` or ``NativeEngine(cfg, model=CausalLM)``."""

    def __init__(self, cfg: EngineConfig, model_dir: str | None = None, model: CausalLM | None = None):
        if (model_dir is None) == (model is None):
            raise ValueError("NativeEngine needs exactly one of model_dir or model")
        self.cfg = cfg
        if model is None:
            device = resolve_device(cfg.device)
            dtype = _DTYPES[cfg.dtype] if cfg.dtype else default_dtype(device)
            model = load_pretrained(model_dir, device=device, dtype=dtype)
        self.weight_dtype = next(model.parameters()).dtype  # values are kept at this precision
        if model_dir is not None and self.weight_dtype != torch.float32 and \
                next(model.parameters()).device.type == "cpu" and _cpu_half_in_fp32(cfg.cpu_half_compute):
            model = model.float()  # bf16/fp16 weight values, fp32 math (see cpu_half_compute)
        if model_dir is not None:  # the engine's own copy; a caller's model keeps its flags
            model = model.eval().requires_grad_(False)  # (every forward runs in inference mode)
        self.model = model
        self.device = next(model.parameters()).device
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.eos_ids = tuple(cfg.eos_ids) if cfg.eos_ids is not None else mc.eos_ids
        check_eos_ids(self.eos_ids, self.vocab_size)
        self.bm = BlockManager(cfg.total_blocks, cfg.block_size, cfg.prefix_caching)
        # a lone sequence must always fit (EngineConfig refuses a max_model_len that does not)
        self.max_model_len = engine_context(cfg, mc.max_position_embeddings, cfg.kv_len)
        self.prefix = PrefixCache(self.bm) if cfg.prefix_sharing else None
        self.attention_backend = resolve_attention_backend(cfg, next(self.model.parameters()).device)
        # the "cpu" kernel takes any mix of tokens: admissions and chunks ride on decode steps
        self.scheduler = Scheduler(self.bm, self.prefix, cfg.max_batch_size, cfg.max_prefill_tokens,
                                   cfg.enable_chunked_prefill, mixed=self.attention_backend == "cpu")
        self.admission = admission_key(cfg.admission)
        kv_dtype = None if cfg.kv_cache_dtype == "auto" else _DTYPES[cfg.kv_cache_dtype]
        compute = next(self.model.parameters()).dtype
        if kv_dtype not in (None, compute) and compute != torch.float32:
            raise ValueError(f"engine.kv_cache_dtype: {cfg.kv_cache_dtype!r} needs an fp32 model "
                             f"(or 'auto'); this engine computes in {compute}")
        self.runner = ModelRunner(self.model, self.bm, self.attention_backend, self.eos_ids, cfg.seed,
                                  self.max_model_len, kv_dtype,
                                  cuda_graph_batch=0 if cfg.enforce_eager else cfg.max_batch_size,
                                  prepack=None if cfg.cpu_prepack == "auto" else cfg.cpu_prepack)
        self._params: list[tuple[dict, str]] = []  # each parameter's module slot, listed at each refresh
        self._params_at = None  # the forward's refresh count they were taken at
        self._hashed_at = self._weights_stamp()  # the weights the cached hashes are of
        self.weight_version = 0
        self._arrival = itertools.count()
        self._live: dict[int, Sequence] = {}  # sample_id -> sequence (waiting or running)
        self._unreturned: list[Sample] = []  # finished by a step a Ctrl-C then left: the next step's
        self._group_live: Counter[int] = Counter()
        self._group_prompt: dict[int, torch.Tensor] = {}  # live group -> its prompt ids
        self._rate = TokenRate()
        self.total_tokens = 0

    def __repr__(self) -> str:
        p = next(self.model.parameters())
        graphs = self.runner.graphs
        decode = f"CUDA-graph decode up to batch {graphs.max_batch}" if graphs else "eager decode"
        attention = self.attention_backend
        if attention == "torch" and p.device.type == "cpu" and self.cfg.attention_backend == "auto":
            attention += " (engine.attention_backend: cpu is faster on CPUs, docs/config.md)"
        return (f"NativeEngine({p.device.type} {str(p.dtype).removeprefix('torch.')}, attention "
                f"{attention}, {decode}, KV {self.bm.num_blocks} x {self.bm.block_size} "
                f"tokens, max batch {self.scheduler.max_batch_size})")

    # ---- requests ------------------------------------------------------------------------
    def _refusal(self, req: Request) -> str | None:
        """Why ``req`` cannot be served, or None: the same rules (and messages) as the vLLM
        backend, from the one shared function."""
        why = refusal(req, self.vocab_size, self.max_model_len, self._live.keys())
        if why is None and req.group_id in self._group_prompt and \
                not torch.equal(self._group_prompt[req.group_id], req.prompt_ids):
            why = (f"group_id {req.group_id} is live with another prompt (the samples of a group "
                   "share one prompt, and its cached prefix)")
        return why

    def add(self, requests: Seq[Request]) -> list[Sample]:
        """Queue valid requests; return refusals (``finish_reason == "error"``) at once."""
        requests = check_requests(requests)
        if not self.has_work():  # a new busy period: stats().kv_blocks_peak counts from here
            self.bm.reset_peak()
        refused = []
        for i, req in enumerate(requests):
            why = self._refusal(req)
            if why is not None:
                refused.append(error_sample(req, f"request {i} (sample_id {req.sample_id}): {why}",
                                            self.weight_version))
                continue
            seq = Sequence.from_request(req, next(self._arrival), self.admission(req))
            self._live[req.sample_id] = seq
            if req.group_id >= 0:
                self._group_live[req.group_id] += 1
                if req.group_id not in self._group_prompt:  # a copy: callers may reuse their tensor
                    self._group_prompt[req.group_id] = req.prompt_ids.clone()
            self.scheduler.add(seq)
        return refused

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._unreturned)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Sample]:
        # a Ctrl-C is held while the bookkeeping changes (admission, the step's tokens, stops, pins
        # and blocks) and raised when it is whole; the forward stays interruptible. The samples of
        # a step whose held Ctrl-C was raised come out of the next one
        with HeldInterrupt() as held, on_device(self.device):  # (an RPC thread's current GPU is 0)
            self._step(held)
        return self._take_unreturned()

    def _step(self, held: HeldInterrupt) -> None:
        batch = None
        try:
            if (self.bm.caching or self.prefix is not None) and self.scheduler.waiting:  # only admissions read them
                self._drop_stale_prefixes()
            batch = self.scheduler.schedule()
            if batch is None:
                return
            now = started = time.time()
            if batch.is_prefill:
                for s in batch.seqs:
                    s.timings.setdefault("admitted", now)
            with held.interruptible():  # (one held in admission is raised here: the batch goes back)
                tokens, logprobs = self.runner.run(batch)
        except BaseException:
            if batch is not None:
                self._requeue(batch)
            raise
        self._unreturned += self._apply(batch, tokens, logprobs, started)

    def _take_unreturned(self) -> list[Sample]:
        out, self._unreturned = self._unreturned, []
        return out

    def _apply(self, batch, tokens: list[int], logprobs: list[float], started: float) -> list[Sample]:
        """The step's tokens appended, the sequences that stop finished (their Samples), a group
        prompt's pin marked ready, the blocks filled registered."""
        if batch.is_prefill:
            for seq, end in zip(batch.seqs, batch.ends):
                if end < seq.num_tokens:  # a prefill chunk: no token yet, more chunks to come
                    seq.num_cached = end
        now = time.time()
        done = []
        eos, max_len = self.eos_ids, self.max_model_len
        for seq, tok, lp in zip(batch.sampling, tokens, logprobs):  # per token of every step: kept lean
            toks, req = seq.tokens, seq.request
            toks.append(tok)
            seq.logprobs.append(lp)
            n = len(toks)
            seq.num_cached = n - 1
            n_out = n - seq.prompt_len
            if n_out == 1:
                seq.timings.setdefault("first_token", now)
            if tok in eos and n_out >= req.min_tokens:
                done.append((seq, "stop"))
            elif n_out >= req.max_tokens or n >= max_len:
                done.append((seq, "length"))
        if self.prefix is not None and batch.is_prefill:
            self.prefix.mark_ready()
        if self.bm.caching:  # only now is the K/V of the blocks this step filled all written
            bs, register = self.bm.block_size, self.bm.register
            for seq in batch.seqs:
                if seq.num_cached // bs > seq.num_hashed:
                    register(seq)
        self._count_tokens(now, len(tokens), started)
        return [self._finish(seq, reason, now) for seq, reason in done]

    def _drop_stale_prefixes(self) -> None:
        """Weights written in place outside ``load_weights`` (a colocated trainer's optimizer step on
        the model this engine was given): cached blocks hold K/V of the old values, so no request
        may start on them: every hash and every group's pinned prompt is dropped, and the running
        sequences (their K/V so far is of the old values too) register no more blocks. ``sync``
        refreshes the fused copies when a parameter changed (the forward's own ``sync`` may have
        done it in an earlier step: ``refreshes`` counts both). Called before steps that may
        admit: a step that admits nothing starts nobody on a cached block, and the forward syncs
        anyway. Every parameter counts, not only those the fused forward copies: an in-place write
        of the embedding, or of o_proj / down_proj / the norms on the plain-GEMM path, left the
        cached K/V of the old values in use (review, s54)."""
        fwd = self.runner.forward
        fwd.sync()
        stamp = self._weights_stamp()
        if stamp == self._hashed_at:
            return
        self._hashed_at = stamp
        self.bm.drop_hashes()
        if self.prefix is not None:
            self.prefix.release_all()
        for seq in self.scheduler.running:  # (``free`` resets it: recomputed, a sequence registers again)
            seq.num_hashed = NEVER_REGISTER

    def _requeue(self, batch) -> None:
        """A step that raised (an engine error, a Ctrl-C in an interactive session) left its batch
        half done: blocks allocated, some layers' K/V written, no token appended. Each of its
        sequences goes back to the queue as a preempted one (blocks freed, a group prompt's
        unready pin dropped, tokens kept): re-admitted, it recomputes its K/V, so the engine can
        be stepped on and every output is what it would have been without the failure."""
        for seq in batch.seqs:
            if seq.status is Status.RUNNING:
                self.scheduler.preempt(seq, count=False)
        for seq in batch.sampling:  # the step may have drawn for them: their seeds replay as if it had not run
            self.runner.sampler.rewind(seq)

    def _finish(self, seq: Sequence, reason: str, now: float) -> Sample:
        self.scheduler.finish(seq)
        self._forget(seq)
        seq.timings["finished"] = now
        return seq.to_sample(reason, self.weight_version)

    def _forget(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the live set and its group's count; the
        group's last sample releases its pinned prefix (and frees the group_id for reuse)."""
        del self._live[seq.request.sample_id]
        gid = seq.group_id
        if gid >= 0:
            self._group_live[gid] -= 1
            if self._group_live[gid] == 0:
                del self._group_live[gid], self._group_prompt[gid]
                if self.prefix is not None:
                    self.prefix.release(gid)

    def abort(self, sample_ids: Iterable[int]) -> list[int]:
        """Cancel requests wherever they are (waiting, preempted, running): their blocks are
        freed, their reference on a shared prompt prefix dropped, and no Sample of them comes
        out of a later ``step()``. Returns the ids aborted, in the order given; unknown or
        already finished ids are ignored (vLLM's ``abort_request``). Called between steps."""
        aborted = []
        for sid in sample_ids:
            seq = self._live.get(sid) if hashable(sid) else None  # (add refused an unhashable one)
            if seq is None:
                if any(s.sample_id == sid for s in self._unreturned):  # finished, not yet returned
                    self._unreturned = [s for s in self._unreturned if s.sample_id != sid]
                    aborted.append(sid)
                continue
            if self.prefix is not None and seq.group_id >= 0:  # computing the shared prompt: its K/V
                self.prefix.release_unready(seq.group_id, seq)  # will never be written (a failed step)
            self.scheduler.abort(seq)
            self._forget(seq)
            aborted.append(sid)
        return aborted

    def _count_tokens(self, now: float, n: int, started: float) -> None:
        self.total_tokens += n
        self._rate.add(now, n, started)

    # ---- control -------------------------------------------------------------------------
    def set_max_batch_size(self, n: int) -> None:
        check_batch_cap(n)
        self.scheduler.set_max_batch_size(n)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     version: int) -> None:
        """Copy HF-named tensors into the model in place (any subset of its parameters).
        Everything is checked, and cast to the engine's weight dtype, before anything is
        written (``request_check.check_weights``: version, names, shapes, meta/non-floating
        tensors, NaN/inf after the cast; ValueError, the weights and the samples in flight
        untouched; a cast that runs out of memory fails before the first write). On success sequences in flight are
        restarted from their prompts (their tokens so far came from the old weights: a
        sample never mixes versions) and cached prefixes are dropped."""
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied: both names
        version, staged = check_weights(named_tensors, {n: p.shape for n, p in params.items()}, version,
                                        self.weight_dtype)  # rounded to it (bf16 stays bf16)
        check_tied(staged, params.get(TIED[0]) is not None and params.get(TIED[0]) is params.get(TIED[1]))
        with torch.no_grad():
            for name, t in staged:
                params[name].copy_(t)
        self.runner.forward.refresh()  # the fused q/k/v and gate/up copies
        self.weight_version = version
        self._restart_in_flight()
        self._hashed_at = self._weights_stamp()

    def _weights_stamp(self) -> tuple:
        """Every parameter's version counter, storage and dtype, read through its module's slot
        (a Parameter object replaced, ``module.weight = nn.Parameter(...)``, is seen), and the
        fused copies' refresh count. The slots are listed again at a refresh: walking the modules
        at every admitting step cost 4-8x the fused stamp."""
        refreshes = self.runner.forward.refreshes
        if self._params_at != refreshes:
            self._params = [(m._parameters, n) for m in self.model.modules()
                            for n, p in m._parameters.items() if p is not None]
            self._params_at = refreshes
        return refreshes, tuple((p._version, p.data_ptr(), p.dtype) for p in (d[n] for d, n in self._params))

    def _restart_in_flight(self) -> None:
        sch = self.scheduler
        for seq in list(sch.running):
            sch.preempt(seq, count=False)
        for seq in list(sch.waiting):
            if seq.num_output:
                seq.reset_output()
        if self.prefix is not None:
            self.prefix.release_all()
        self.bm.drop_hashes()  # their K/V is of the old weights

    def close(self) -> None:
        """Nothing to stop: the model and the KV cache live in this process and go with the
        engine object (the model may be a trainer's, shared when colocated). Idempotent."""

    def stats(self) -> EngineStats:
        tps = self._rate.rate(time.time())
        return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           kv_blocks_used=self.bm.num_used, kv_blocks_free=self.bm.num_free,
                           tokens_per_s=tps, max_batch_size=self.scheduler.max_batch_size,
                           weight_version=self.weight_version,
                           preemptions=self.scheduler.preemptions, kv_blocks_peak=self.bm.peak,
                           prefix_cache_hit_tokens=self.scheduler.prefix_hit_tokens)
