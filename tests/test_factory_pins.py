"""workers/generation/factory.make_engine (mutation review, s59): every key of the multi_turn section and the EOS override reach the engine."""
import pytest

from controller.config import MultiTurnSection
from runtime_helpers import tiny_model  # noqa: F401  (fixture)
from workers.generation.config import EngineConfig
from workers.generation.factory import make_engine
from workers.tokenizer import Tokenizer


def test_make_engine_wraps_with_every_key_of_the_multi_turn_section(tiny_model):  # noqa: F811
    """workers/generation/factory.py _multi_turn: the section's max_turns, observation cap, the
    side a long observation is cut on (verl's tool_response_truncate_side), the env workers and
    the caller's tokenizer (the one the prompts were encoded with) all reach the MultiTurnEngine;
    each non-default here, so a key dropped for its default is seen."""
    tok = Tokenizer.load(tiny_model)
    section = MultiTurnSection(env="calculator", max_turns=2, max_observation_tokens=7,
                               observation_truncate_side="left", workers=2)
    eng = make_engine(EngineConfig(device="cpu", kv_cache_tokens=256), tiny_model, multi_turn=section, tokenizer=tok)
    try:
        assert (eng.max_turns, eng.max_observation_tokens, eng.truncate_side) == (2, 7, "left")
        assert eng.pool._max_workers == 2 and eng.tokenizer is tok
    finally:
        eng.close()


@pytest.mark.parametrize("eos, want", [(9, (9,)), ([5, 6], (5, 6)), ((), ())])
def test_make_engine_eos_override_takes_an_int_a_list_and_none(tiny_model, eos, want):  # noqa: F811
    """``eos_ids`` overrides the folder's EOS: one id, several (Qwen's chat models stop on two),
    or none at all (``()``: generate to max_tokens), never the folder's then."""
    eng = make_engine(EngineConfig(device="cpu", kv_cache_tokens=256), tiny_model, eos_ids=eos)
    try:
        assert tuple(eng.eos_ids) == want
    finally:
        eng.close()
