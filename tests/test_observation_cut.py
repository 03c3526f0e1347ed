"""``cut_observation`` (verl's ``tool_response_truncate_side``) on text a byte-level tokenizer
splits inside characters (the cut of a whole multi-turn run: tests/test_multi_turn_engine.py)."""
import pytest

from test_multi_turn_engine import LONG, TOK
from workers.generation.observations import cut_observation


def test_a_cut_never_splits_a_character():
    """Byte-level tokens split a CJK character in three: the cut decoded each side on its own and
    kept U+FFFD halves the tool never said (26 of 33 cuts here). A kept part is the content's own
    text now, and holds no more tokens than its share."""
    content = "结果是四十二。天气晴朗，温度二十五度。" * 3
    assert len(TOK.encode("结", add_special_tokens=False)) > 1  # (the test's premise)
    for side in ("left", "middle", "right"):
        for limit in range(1, 12):
            cut = cut_observation(TOK, content, limit, side)
            assert "\ufffd" not in cut, (side, limit, cut)
            head, _, tail = cut.partition({"left": "...(truncated)", "right": "(truncated)...",
                                            "middle": "...(truncated)..."}[side])
            assert content.startswith(head) and content.endswith(tail)
            assert len(TOK.encode(head + tail, add_special_tokens=False)) <= limit


def test_an_unknown_truncate_side_is_refused():
    with pytest.raises(ValueError, match="truncate side 'top'"):
        cut_observation(TOK, LONG, 2, "top")
