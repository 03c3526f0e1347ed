"""DecodeInputs: the kept decode tensors equal a fresh build after every kind of change."""
import random

import torch

from workers.generation.decode_inputs import DecodeInputs
from workers.generation.sequence import Sequence
from workers.types import Request

BS = 4


def seq(i: int, n: int, rng: random.Random) -> Sequence:
    s = Sequence.from_request(Request(sample_id=i, prompt_ids=torch.arange(n), max_tokens=99), arrival=i)
    s.block_table = [rng.randrange(1, 1000) for _ in range(-(-n // BS))]
    return s


def fresh(seqs: list[Sequence]):
    return DecodeInputs(BS, torch.device("cpu"))(seqs, [])


def same(got, want) -> None:
    for name in ("ids", "positions", "slots", "context_lens", "seq_of"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    w = int((want.block_tables != 0).sum(1).max())  # the widths differ: past the tables, zeros
    assert torch.equal(got.block_tables[:, :w], want.block_tables[:, :w])
    assert not got.block_tables[:, w:].any() and not want.block_tables[:, w:].any()


def advance(s: Sequence, tok: int, rng: random.Random) -> None:
    s.tokens.append(tok)
    if len(s.block_table) * BS < s.num_tokens:  # the scheduler's job: a new block for the new slot
        s.block_table.append(rng.randrange(1, 1000))


def test_kept_inputs_equal_a_fresh_build_through_growth_and_changes():
    rng = random.Random(0)
    seqs = [seq(i, rng.randint(1, 9), rng) for i in range(6)]
    di = DecodeInputs(BS, torch.device("cpu"))
    same(di(seqs, []), fresh(seqs))
    for step in range(60):
        for s in seqs:
            advance(s, rng.randrange(50), rng)
        copies = []
        if step == 20:  # a sequence leaves the batch
            seqs = seqs[:2] + seqs[3:]
        if step == 30:  # a new one joins at the end
            seqs.append(seq(99, 3, rng))
        if step == 40:  # copy-on-write: the last block replaced
            seqs[0].block_table[-1] = 1234
            copies = [(5, 1234)]
        if step == 45:  # a table grows by more blocks than the kept width has room for
            seqs[1].block_table += [7] * 8
        same(di(seqs, copies), fresh(seqs))
    # kept on the other 55 steps: rebuilt at the first call, the four changes above, and once
    # when a growing table outran the spare columns
    assert di.rebuilds == 6


def test_a_shrunk_table_or_an_invalidation_rebuilds():
    rng = random.Random(1)
    seqs = [seq(i, 5, rng) for i in range(3)]
    di = DecodeInputs(BS, torch.device("cpu"))
    di(seqs, [])
    for s in seqs:
        advance(s, 1, rng)
    same(di(seqs, []), fresh(seqs))
    assert di.rebuilds == 1
    seqs[1].tokens[2:] = []  # recomputed from a shorter state elsewhere: fewer blocks
    seqs[1].block_table[1:] = []
    same(di(seqs, []), fresh(seqs))
    assert di.rebuilds == 2
    di.invalidate()  # what a prefill step does: a recomputed sequence may have new blocks
    seqs[0].block_table[0] = 999
    same(di(seqs, []), fresh(seqs))
    assert di.rebuilds == 3


def test_same_count_other_sequences_or_order_rebuilds_the_table():
    """A batch of as many sequences as the last one, with the same table lengths, but other
    sequences in its rows (two swapped, one replaced by another): the kept table must not be
    reused row for row."""
    rng = random.Random(2)
    a, b, c = seq(0, 6, rng), seq(1, 7, rng), seq(2, 5, rng)
    di = DecodeInputs(BS, torch.device("cpu"))
    same(di([a, b], []), fresh([a, b]))
    same(di([b, a], []), fresh([b, a]))  # reordered
    same(di([b, c], []), fresh([b, c]))  # a left, c (2 blocks too) took its row
    assert di.rebuilds == 3
