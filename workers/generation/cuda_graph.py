"""DecodeGraphs: the decode step (forward + lm_head) replayed from CUDA graphs.

A decode step of a small model on a GPU is hundreds of short kernels; launching them from
Python costs more than running them (measured on an H200: the eager engine at 0.8x the speed
of transformers' ``generate`` on the tiny workload, while the kernels themselves ran in a
fraction of the step). Like vLLM, the engine captures the decode forward once per padded
batch size and replays it:

* inputs live in static buffers (token ids, positions, cache slots, block tables, context
  lengths) sized for ``max_batch`` sequences of ``max_blocks`` blocks; a step copies its
  values in and replays the graph of the smallest captured size >= its batch;
* padded rows have context length 0 (the decode kernel gives zeros for them) and write their
  K/V into a scratch block that the block manager never hands out;
* attention is the Triton paged-decode kernel (``attention_backend="triton"``): it reads the
  lengths on the device and chooses its launch from shapes only, so nothing syncs with the
  host inside the graph. Prefill stays eager.

Graphs are captured lazily, on the first step of each size, into one shared memory pool.
``FusedForward.refresh`` writes new weights into the tensors the graphs read
(``FusedForward.epoch`` changes only when a tensor was replaced; then the graphs are
dropped and recaptured).
"""
from __future__ import annotations

import torch

from workers.generation.attention import PagedAttention, StepContext
from workers.generation.sampler import to_device


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then multiples of 8 up to 64 and of 32 beyond."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8))
    sizes += list(range(96, max_batch + 1, 32))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, forward, attn: PagedAttention, max_batch: int, max_blocks: int,
                 scratch_slot: int, device: torch.device):
        self.forward, self.attn, self.device = forward, attn, device
        self.sizes = capture_sizes(max_batch)
        self.max_batch, self.max_blocks, self.scratch_slot = max_batch, max_blocks, scratch_slot
        z = dict(device=device)
        self.ids = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.pos = torch.zeros(max_batch, dtype=torch.int64, **z)
        self.slots = torch.full((max_batch,), scratch_slot, dtype=torch.int64, **z)
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, **z)
        self.lens = torch.zeros(max_batch, dtype=torch.int32, **z)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.epoch = forward.epoch
        self.captures = 0  # graphs captured so far (recaptures after a weight swap included)

    def fits(self, batch: int, width: int) -> bool:
        return batch <= self.max_batch and width <= self.max_blocks

    def _size(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def _context(self, b: int) -> StepContext:
        return StepContext(is_prefill=False, slot_mapping=self.slots[:b], block_tables=self.tables[:b],
                           context_lens=self.lens[:b], positions=self.pos[:b])

    def _step(self, b: int) -> torch.Tensor:
        self.attn.ctx = self._context(b)
        return self.forward.logits(self.forward(self.ids[:b], self.pos[:b], self.attn))

    def _capture(self, b: int) -> None:
        self.lens[:b].zero_()  # warm-up and capture write only into the scratch block
        self.slots[:b].fill_(self.scratch_slot)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # first calls (triton compiles, cuBLAS picks) outside the graph
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # a stream of this GPU: torch's default capture stream is made once, on whichever GPU is
        # current the first time any thread captures
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            out = self._step(b)
        self.pool = graph.pool()
        self.graphs[b] = (graph, out)
        self.captures += 1

    def run(self, ids: list[int], pos: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int]) -> torch.Tensor:
        """One decode step of ``len(ids)`` sequences -> logits [B, V] (a view of a graph output:
        valid until the next replay)."""
        self.forward.sync()  # new weights are copied into the captured tensors in place
        if self.forward.epoch != self.epoch:  # a tensor was replaced: the graphs read stale ones
            self.graphs.clear()
            self.epoch = self.forward.epoch
        n, width = len(ids), len(tables[0])
        b = self._size(n)
        if b not in self.graphs:
            self._capture(b)
        dev = to_device([ids, pos, slots, lens], torch.int64, self.device)  # [4, n]
        self.ids[:n].copy_(dev[0])
        self.pos[:n].copy_(dev[1])
        self.slots[:n].copy_(dev[2])
        self.lens[:n].copy_(dev[3])
        if b > n:  # padded rows: nothing to attend, K/V into the scratch block
            self.lens[n:b].zero_()
            self.slots[n:b].fill_(self.scratch_slot)
            self.pos[n:b].zero_()
        # entries past a length are never read
        self.tables[:n, :width].copy_(to_device(tables, torch.int32, self.device))
        graph, out = self.graphs[b]
        graph.replay()
        self.attn.ctx = None
        return out[:n]
