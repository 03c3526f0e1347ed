"""ModelRunner: turns a scheduled batch into one forward over the paged cache + sampling.

Owns the model, the KV cache, the attention backend and the sampler. Inputs are built from
the sequences' Python state in a few list comprehensions, moved to the device in one go,
and the sampled ids/log-probs come back in one device->host transfer per step.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from workers.generation.attention import PagedAttention, StepContext
from workers.generation.block_manager import BlockManager
from workers.generation.decode_inputs import DecodeInputs, token_inputs
from workers.generation.fused_forward import FusedForward
from workers.generation.kv_cache import KVCache
from workers.generation.sampler import Sampler, to_device
from workers.generation.scheduler import ScheduledBatch
from workers.generation.sequence import Sequence
from workers.model import CausalLM

log = logging.getLogger("streamrl.engine")


@functools.cache
def tune_cpu_malloc() -> bool:
    """Keep freed memory in the process (glibc): the per-step temporaries of a few MB would
    otherwise be mmap'ed and page-faulted afresh every layer of every step, which costs more
    than the copies themselves. Process-wide, harmless; False where not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


def graphs_supported(device: torch.device, attention_backend: str) -> bool:
    """CUDA graphs of the decode step: on CUDA with the sync-free "triton" decode kernel."""
    return device.type == "cuda" and attention_backend == "triton"


class ModelRunner:
    def __init__(self, model: CausalLM, blocks: BlockManager, attention_backend: str,
                 eos_ids: tuple[int, ...], seed: int, max_len: int, kv_dtype: torch.dtype | None = None,
                 cuda_graph_batch: int = 0, prepack: bool | None = None):
        """``cuda_graph_batch`` > 0: decode steps of up to that many sequences replay CUDA
        graphs (CUDA and the "triton" backend only; see cuda_graph.py). ``prepack``: the
        forward's prepacked CPU GEMMs (None: where they are preferred; ``FusedForward``)."""
        cfg = model.config
        p = next(model.parameters())
        self.model, self.bm, self.device = model, blocks, p.device
        # positions < max_len; the "cpu" backend's toolchain also builds the fused C++ ops
        self.forward = FusedForward(model, max_len, cpu_ops=attention_backend == "cpu", prepack=prepack)
        graphs = cuda_graph_batch > 0 and graphs_supported(p.device, attention_backend)
        # with graphs, one more block than the manager hands out: padded rows write K/V there
        self.cache = KVCache(cfg.num_hidden_layers, blocks.num_blocks + graphs, blocks.block_size,
                             cfg.num_key_value_heads, cfg.dim_head, kv_dtype or p.dtype, p.device)
        self.attn = PagedAttention(self.cache, cfg.num_attention_heads, cfg.dim_head, attention_backend)
        self.sampler = Sampler(eos_ids, p.device, seed, fused=self.forward.ops)  # ops: the "cpu" backend's
        self.decode_inputs = DecodeInputs(blocks.block_size, p.device, ctx_int64=self.attn.uses_cpu_kernel)
        self.graphs = None
        if graphs:
            from workers.generation.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self.forward, self.attn, cuda_graph_batch,
                                       -(-max_len // blocks.block_size),
                                       blocks.num_blocks * blocks.block_size, p.device)
        if p.device.type == "cpu":
            tune_cpu_malloc()

    def _to_dev(self, data, dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _block_tables(self, seqs: list[Sequence]) -> tuple[list[list[int]], int]:
        width = max(len(s.block_table) for s in seqs)
        return [s.block_table + [0] * (width - len(s.block_table)) for s in seqs], width

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sets the attention context; returns (ids [T], positions [T], last_index [B] or None)."""
        if batch.is_prefill:
            self.decode_inputs.invalidate()  # a recomputed sequence may have new blocks
        elif not self.attn.needs_mask(False):
            d = self.decode_inputs(batch.seqs, batch.copies)
            self.attn.ctx = StepContext(is_prefill=False, slot_mapping=d.slots, block_tables=d.block_tables,
                                        context_lens=d.context_lens, positions=d.positions,
                                        seq_of=d.seq_of if self.attn.uses_cpu_kernel else None)
            return d.ids, d.positions, None
        seqs, bs = batch.seqs, self.bm.block_size
        tables, width = self._block_tables(seqs)
        ctx_lens = list(batch.ends)  # decode: num_tokens; prefill: where this step's chunk ends
        q_index = seq_of = last = None
        max_q = 1
        if batch.is_prefill:
            ids, pos, slots, q_index, seq_of, last = [], [], [], [], [], []
            max_q = max(e - s.num_cached for s, e in zip(seqs, ctx_lens))
            for b, (s, n1) in enumerate(zip(seqs, ctx_lens)):
                n0 = s.num_cached
                ids += s.tokens[n0:n1]
                pos += range(n0, n1)
                slots += [tables[b][i // bs] * bs + i % bs for i in range(n0, n1)]
                q_index += range(b * max_q, b * max_q + n1 - n0)
                seq_of += [b] * (n1 - n0)
                if n1 == s.num_tokens:  # its last token: logits for the next one
                    last.append(len(ids) - 1)
        else:
            ids, pos, slots, _ = token_inputs(seqs, bs)  # ctx_lens: each one's num_tokens
        bt = self._to_dev(tables, torch.int32)
        pos_t = self._to_dev(pos, torch.int64)
        ctx = StepContext(is_prefill=batch.is_prefill, slot_mapping=self._to_dev(slots, torch.int64),
                          block_tables=bt, context_lens=self._to_dev(ctx_lens, torch.int32),
                          max_q_len=max_q, positions=pos_t)
        if self.attn.needs_mask(batch.is_prefill):
            lk = width * bs
            if batch.is_prefill:
                q_pos = torch.tensor([s.num_cached for s in seqs])[:, None] + torch.arange(max_q)  # [B, Lq]
                mask = torch.arange(lk)[None, None, :] <= q_pos[:, :, None]  # [B, Lq, Lk]
                ctx.q_index = self._to_dev(q_index, torch.int64)
            else:
                mask = (torch.arange(lk)[None, :] < torch.tensor(ctx_lens)[:, None])[:, None]  # [B, 1, Lk]
            ctx.key_mask = to_device(mask[:, None], torch.bool, self.device)
            pad = torch.arange(lk)[None, :] >= torch.tensor(ctx_lens)[:, None]  # [B, Lk]
            ctx.key_pad = to_device(pad[:, :, None, None], torch.bool, self.device)
            ctx.gather_idx = bt.flatten().long()
        elif self.attn.uses_cpu_kernel:  # a prefill: the kernel's decode steps took DecodeInputs above
            ctx.seq_of = self._to_dev(seq_of, torch.int64)
        self.attn.ctx = ctx
        last_t = None if last is None else self._to_dev(last, torch.int64)
        return self._to_dev(ids, torch.int64), pos_t, last_t

    def _graph_decode(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Logits [B, V] of a decode step from the CUDA graphs; None when it doesn't fit them."""
        seqs = batch.seqs
        tables, width = self._block_tables(seqs)
        if not self.graphs.fits(len(seqs), width):
            return None
        ids, pos, slots, lens = token_inputs(seqs, self.bm.block_size)
        try:
            return self.graphs.run(ids, pos, slots, tables, lens)
        except RuntimeError as e:  # a capture the driver refused: serve on, eagerly
            log.warning("CUDA graph decode failed (%s); this engine decodes eagerly from now on", e)
            self.graphs = None
            return None

    def _sample(self, batch: ScheduledBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.cache.copy_blocks(batch.copies)
        logits = self._graph_decode(batch) if self.graphs is not None and not batch.is_prefill else None
        if logits is None:
            ids, pos, last = self._prepare(batch)
            hidden = self.forward(ids, pos, self.attn)  # [T, D]
            if not batch.sampling:
                return None, None
            if last is not None:
                hidden = hidden.index_select(0, last)  # [B, D]
            logits = self.forward.logits(hidden)  # [B, V]
        return self.sampler(logits, batch.sampling)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float]]:
        """One forward + sampling; returns the sampled ids and their log-probs (host lists).
        The attention context lives for the step only, also when the step raises."""
        try:
            tok, logp = self._sample(batch)
        finally:
            self.attn.ctx = None
        if tok is None:  # prefill chunks only: nothing to sample yet
            return [], []
        if self.device.type == "cpu":
            return tok.tolist(), logp.tolist()
        both = torch.stack((tok.double(), logp.double())).cpu().tolist()  # the one sync per step
        return [int(t) for t in both[0]], both[1]
