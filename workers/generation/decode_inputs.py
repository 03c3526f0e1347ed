"""DecodeInputs: a decode step's input tensors, built with as few torch ops as possible.

Between two decode steps of the same running batch every sequence has gained one token and
its block table at most a block at the end. So, as vLLM V1 keeps its persistent input batch,
the block-table tensor of the last decode step is kept and only the blocks a sequence gained
are written into its row; another set or order of sequences, a copy-on-write block copy, a
prefill step in between (``invalidate``: a recomputed sequence has new blocks) or a table
wider than the kept one rebuilds it. The per-token vectors (ids, positions, cache slots,
context lengths) are computed in Python from the sequences' lists and become one tensor
(through an ``array``: a third of ``torch.tensor(list)``'s time).

Why the op count matters more than the Python: inside a decode step, after the forward has
swept the caches, a small torch op costs 2-3x what it costs alone (the slots as a gather and
three arithmetic ops: ~95 us in a step of workload (a), ~15 us alone), so building five
tensors a step took ~0.2 ms of a ~6 ms step; this way it is a handful of ops (one tensor from
an array, a view, an unbind), plus one per row whose table grew.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from operator import is_

import torch

from workers.generation.sampler import to_device
from workers.generation.sequence import Sequence

WIDTH_SLACK = 4  # block-table columns kept beyond the widest table at a rebuild


@dataclass
class DecodeTensors:
    """ids, positions, slots: int64 [B]; block_tables: int32 [B, W] (zero-padded);
    context_lens: int32 [B] (int64 with ``ctx_int64``); seq_of: int64 [B] (= arange, the row
    of each query)."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    seq_of: torch.Tensor


def token_inputs(seqs: list[Sequence], block_size: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """A decode step's per-sequence (ids, positions, cache slots, context lengths) as lists:
    each sequence's last token, written at its last position."""
    bs = block_size
    ids, pos, slots, ntok = [], [], [], []
    for s in seqs:
        toks, table = s.tokens, s.block_table
        n = len(toks)
        p = n - 1
        ids.append(toks[-1])
        pos.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        ntok.append(n)
    return ids, pos, slots, ntok


class DecodeInputs:
    def __init__(self, block_size: int, device: torch.device, ctx_int64: bool = False):
        """``ctx_int64``: the context lengths may stay int64 (the "cpu" kernel does not read
        them): one op fewer a step."""
        self.bs, self.device, self.ctx_int64 = block_size, device, ctx_int64
        self._seqs: list[Sequence] = []
        self._nblk: list[int] = []  # each sequence's block-table length when the table was kept
        self._tables: torch.Tensor | None = None
        self._seq_of: torch.Tensor | None = None
        self.rebuilds = 0  # block-table rebuilds (a test and the curious read it)

    def invalidate(self) -> None:
        """Forget the kept block table (the next decode step builds it afresh)."""
        self._tables = None

    def __call__(self, seqs: list[Sequence], copies: list) -> DecodeTensors:
        tables = self._block_tables(seqs, copies)
        ids, pos, slots, ntok = token_inputs(seqs, self.bs)
        # array -> tensor: ~8 us for 256 ints, against ~27 us for torch.tensor(list)
        flat = torch.frombuffer(array("q", ids + pos + slots + ntok), dtype=torch.int64)
        ids_t, pos_t, slots_t, ctx_t = to_device(flat, torch.int64, self.device).view(4, -1).unbind(0)
        if not self.ctx_int64:
            ctx_t = ctx_t.to(torch.int32)
        return DecodeTensors(ids=ids_t, positions=pos_t, slots=slots_t, block_tables=tables,
                             context_lens=ctx_t, seq_of=self._seq_of)

    def _block_tables(self, seqs: list[Sequence], copies: list) -> torch.Tensor:
        t = self._tables
        if t is None or copies or len(seqs) != len(self._seqs) or not all(map(is_, seqs, self._seqs)):
            return self._build(seqs)
        nblk = [len(s.block_table) for s in seqs]
        if nblk != self._nblk:
            if max(nblk) > t.shape[1] or any(map(int.__lt__, nblk, self._nblk)):
                return self._build(seqs)
            for row, (old, new) in enumerate(zip(self._nblk, nblk)):
                if new != old:  # blocks only ever get appended to a running sequence's table
                    t[row, old:new] = to_device(seqs[row].block_table[old:new], torch.int32, self.device)
            self._nblk = nblk
        return t

    def _build(self, seqs: list[Sequence]) -> torch.Tensor:
        self.rebuilds += 1
        nblk = [len(s.block_table) for s in seqs]
        width = max(nblk) + WIDTH_SLACK
        self._tables = to_device([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                                 torch.int32, self.device)
        if self._seq_of is None or len(self._seq_of) != len(seqs):
            self._seq_of = torch.arange(len(seqs), device=self.device)
        self._seqs, self._nblk = list(seqs), nblk
        return self._tables
