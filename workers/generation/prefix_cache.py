"""PrefixCache: the prompt blocks of a GRPO group, shared by its n samples.

The first sample of a group to be admitted computes the prompt; its blocks holding prompt
tokens ``[0, P-1)`` are then *pinned* (one extra reference) under the group id. Later
samples of the group start with those blocks in their table and ``num_cached = P - 1``: they
compute only the last prompt token (whose logits give their first sampled token), writing it
into a private copy of the last, partial block (copy-on-write in ``BlockManager``).
A pin is dropped when the group has no live sample left, on new weights (the cached K/V
belongs to the old ones), under memory pressure when none of its samples is running, and when
the sample computing it is aborted before its K/V was written (``release_unready``).
"""
from __future__ import annotations

from dataclasses import dataclass

from workers.generation.block_manager import BlockManager
from workers.generation.sequence import Sequence


@dataclass
class GroupPrefix:
    prompt: tuple[int, ...]
    blocks: list[int]
    owner: Sequence  # the sample computing the prompt
    ready: bool = False  # K/V written (set after the step that computed its last prefix token)


class PrefixCache:
    def __init__(self, blocks: BlockManager):
        self.bm = blocks
        self.groups: dict[int, GroupPrefix] = {}

    def lookup(self, seq: Sequence) -> GroupPrefix | None:
        """The group's prefix when it exists and matches ``seq``'s prompt (ready or not)."""
        g = self.groups.get(seq.group_id)
        if g is None or len(g.prompt) != seq.prompt_len or g.prompt != tuple(seq.tokens[:seq.prompt_len]):
            return None
        return g

    def attach(self, seq: Sequence, g: GroupPrefix) -> None:
        """Start ``seq`` on the group's cached prefix (``seq`` holds no blocks yet)."""
        self.bm.share(seq, g.blocks)
        seq.num_cached = seq.prompt_len - 1

    def pin(self, seq: Sequence) -> None:
        """Register ``seq``'s prompt blocks (allocated, computed this step) for its group."""
        n = self.bm.blocks_for(seq.prompt_len - 1)
        if seq.group_id < 0 or n == 0 or seq.group_id in self.groups:
            return
        blocks = seq.block_table[:n]
        self.bm.incref(blocks)
        self.groups[seq.group_id] = GroupPrefix(tuple(seq.tokens[:seq.prompt_len]), blocks, seq)

    def mark_ready(self) -> None:
        """After a step: prefixes whose owner now has tokens ``[0, P-1)`` in the cache (a
        chunked prefill may take several steps) are ready to share."""
        for g in self.groups.values():
            if not g.ready and g.owner.num_cached >= len(g.prompt) - 1:
                g.ready = True

    def release(self, group_id: int) -> None:
        g = self.groups.pop(group_id, None)
        if g is not None:
            self.bm.decref(g.blocks)

    def release_unready(self, group_id: int, owner: Sequence | None = None) -> None:
        """Drop the group's pin if its K/V was never written (the step computing it failed and
        its sample is being aborted): nobody would write it, and the group's other samples
        wait for ``ready``; without the pin the next of them computes the prompt itself.
        ``owner``: only when that sample is the one computing it (aborting a waiting sibling
        used to throw away a prompt still being computed: every other sample recomputed it)."""
        g = self.groups.get(group_id)
        if g is not None and not g.ready and (owner is None or g.owner is owner):
            self.release(group_id)

    def release_all(self) -> None:
        for gid in list(self.groups):
            self.release(gid)

    def evict_idle(self, running_groups: set[int]) -> bool:
        """Drop one pin whose group has no running sample (frees its blocks). False if none."""
        for gid in self.groups:
            if gid not in running_groups:
                self.release(gid)
                return True
        return False
