"""The controller's prompt stream (``controller/data.py``): a shuffle per epoch, resumable, and
no prompt twice in a batch that runs into the next epoch, a data digest that covers the
answers."""
import json

import pytest

from controller.data import PromptStream, digest
from workers.types import TaskPrompt


def _items(n):
    return [TaskPrompt(f"p{i}", str(i), "t") for i in range(n)]


def test_prompt_stream_resumes_the_same_sequence():
    a = PromptStream(_items(10), seed=3)
    first = [x.prompt for x in a.next(7)]
    state = a.state_dict()
    rest = [x.prompt for x in a.next(12)]  # crosses an epoch boundary (reshuffle)
    b = PromptStream(_items(10), seed=3, state=json.loads(json.dumps(state)))
    assert [x.prompt for x in b.next(12)] == rest
    assert len(set(first + rest[:3])) == 10  # an epoch is a permutation
    assert [x.prompt for x in PromptStream(_items(10), seed=4).next(7)] != first


def test_a_resume_over_other_prompts_says_the_position_falls_elsewhere(capsys):
    state = json.loads(json.dumps(PromptStream(_items(10), seed=3).state_dict()))
    PromptStream(_items(10), seed=3, state=state)
    assert capsys.readouterr().err == ""
    edited = _items(11)  # a row added to the data file
    PromptStream(edited, seed=3, state=state)
    assert "the train prompts differ from those the checkpoint's position counts in (10 then, 11 now" \
        in capsys.readouterr().err
    old = {k: v for k, v in state.items() if k not in ("items", "digest")}  # a checkpoint from before
    assert PromptStream(edited, seed=3, state=old).state_dict()["items"] == 11 and capsys.readouterr().err == ""


def test_edited_chats_and_another_seed_are_said_on_resume(capsys):
    from dataclasses import replace

    chats = [replace(it, messages=({"role": "system", "content": "French"}, {"role": "user", "content": it.prompt}))
             for it in _items(6)]
    state = json.loads(json.dumps(PromptStream(chats, seed=0).state_dict()))
    german = [replace(it, messages=({"role": "system", "content": "German"}, it.messages[1])) for it in chats]
    PromptStream(german, seed=0, state=state)  # same last user turns and answers: used to say nothing
    assert "the train prompts differ" in capsys.readouterr().err
    s = PromptStream(chats, seed=123, state=state)  # a new train.seed on resume
    assert s.state.seed == 0
    assert "train.seed 123: the prompt order keeps the checkpoint's seed 0" in capsys.readouterr().err


@pytest.mark.parametrize("size,batch", [(10, 4), (7, 3), (5, 5), (9, 8)])
def test_a_batch_into_the_next_epoch_has_no_prompt_twice(size, batch):
    """The batch that ran past an epoch's end took the next epoch's first prompts, which could be
    the ones it had (10 prompts, 4 a batch: 40 of 500 batches over 50 seeds; review, session 52);
    verl's drop_last loader makes no such batch. Every epoch is still a permutation, and a resume
    at any batch continues the same sequence."""
    for seed in range(30):
        s = PromptStream(_items(size), seed=seed)
        seq, states = [], []
        for _ in range(3 * size):
            states.append(json.loads(json.dumps(s.state_dict())))
            got = [x.prompt for x in s.next(batch)]
            assert len(set(got)) == batch, (seed, got)
            seq.append(got)
        flat = [p for b in seq for p in b]
        for e in range(len(flat) // size):  # each epoch's prompts, in the order taken, are all of them
            assert len(set(flat[e * size:(e + 1) * size])) == size, (seed, e)
        for at in (1, size // 2, size + 1):
            again = PromptStream(_items(size), seed=seed, state=states[at])
            assert [[x.prompt for x in again.next(batch)] for _ in range(4)] == seq[at:at + 4]


def test_more_prompts_a_batch_than_the_split_holds_still_repeats_them():
    """(Only ``train.iterations`` allows it; ``train.epochs`` refuses such a batch.)"""
    got = [x.prompt for x in PromptStream(_items(3), seed=0).next(7)]
    assert len(got) == 7 and set(got) == {"p0", "p1", "p2"}


def test_each_epoch_is_shuffled_anew():
    """(A shuffle seeded without the epoch passed every test above: mutation review, s56.)"""
    s = PromptStream(_items(20), seed=0)
    first, second = s.next(20), s.next(20)
    assert sorted(t.prompt for t in first) == sorted(t.prompt for t in second)
    assert [t.prompt for t in first] != [t.prompt for t in second]


def test_the_data_digest_covers_the_answers():
    """A resume over a dataset whose answers were edited is warned about (the digest differs)."""
    items = _items(5)
    assert digest(items) != digest([TaskPrompt(t.prompt, t.answer + "0", t.task) for t in items])
