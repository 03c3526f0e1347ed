"""How an environment's answer becomes tokens of a multi-turn response (``MultiTurnEngine``,
workers/generation/multi_turn.py; docs/multi_turn.md): the answer as a chat message, its content
cut as verl cuts a tool response, and the tokens the chat template renders for it after an
assistant turn, up to the next assistant turn's generation prompt."""
from __future__ import annotations

_SYSTEM = {"role": "system", "content": ""}


def observation_message(out) -> dict | None:
    """The environment's answer as a chat message (None: done); anything else is a TypeError."""
    if out is None:
        return None
    if isinstance(out, str):
        return {"role": "tool", "content": out}
    if isinstance(out, dict) and isinstance(out.get("role"), str) and "content" in out:
        return out
    raise TypeError(f"returned a {type(out).__name__} ({str(out)[:80]!r}); an environment returns a str (a tool "
                    "message), a dict with 'role' and 'content', or None (done)")


def cut_observation(tokenizer, content: str, limit: int, side: str = "middle") -> str:
    """``content`` cut to ``limit`` of its tokens, as verl cuts a tool response
    (``tool_response_truncate_side``): "left" keeps its start (+ "...(truncated)"), "right" its
    end ("(truncated)..." +), "middle" both ends (half each, "...(truncated)..." between);
    as is when it fits. The cut is on the content, before the chat template wraps it, so the
    next assistant turn's generation prompt is never cut off."""
    ids = tokenizer.encode(content, add_special_tokens=False)
    if len(ids) <= limit:
        return content

    def text(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False)

    if side == "left":
        return text(ids[:limit]) + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text(ids[-limit:])
    if side != "middle":
        raise ValueError(f"truncate side {side!r}: one of left, middle, right")
    head = limit // 2
    return text(ids[:head]) + "...(truncated)..." + text(ids[len(ids) - (limit - head):])


def observation_ids(tokenizer, message: dict) -> list[int]:
    """Token ids of an observation as the chat template renders it after an assistant turn, ending
    with the next assistant turn's generation prompt (the text the template adds for ``message``
    after a conversation, taken past an empty system turn); without a template, its content as is."""
    if not tokenizer.chat_template:
        return tokenizer.encode(str(message.get("content") or ""), add_special_tokens=False)
    before = tokenizer.apply_chat_template([_SYSTEM], add_generation_prompt=False)
    after = tokenizer.apply_chat_template([_SYSTEM, message], add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(f"the tokenizer's chat template renders [system] as {before[-80:]!r}, which is not the "
                         f"start of its rendering of [system, {message.get('role')}] ({after[:120]!r}): the "
                         "observation's tokens cannot be taken from it")
    return tokenizer.encode(after[len(before):], add_special_tokens=False)
