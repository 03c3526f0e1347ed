"""How an environment's answer becomes tokens of a multi-turn response (``MultiTurnEngine``,
workers/generation/multi_turn.py; docs/multi_turn.md): the answer as a chat message, its content
cut as verl cuts a tool response, and the tokens the chat template renders for it after an
assistant turn, up to the next assistant turn's generation prompt."""
from __future__ import annotations

from workers.finite import finite_number

_SYSTEM = {"role": "system", "content": ""}


def observation_message(out) -> tuple[dict | None, float | None]:
    """The environment's answer -> (the observation as a chat message, or None: done; the turn's
    reward, or None: none given). A str is a tool message; a dict is a message (``role``,
    ``content``, a str or OpenAI text parts, joined) and may carry ``reward`` (a finite number: the reward of the turn just taken,
    verl's tool reward) and ``done`` (true: the trajectory ends here, no message appended);
    anything else is a TypeError (a bad reward a ValueError) saying what it was."""
    if out is None:
        return None, None
    if isinstance(out, str):
        return {"role": "tool", "content": out}, None
    if not isinstance(out, dict):
        raise TypeError(f"returned a {type(out).__name__} ({str(out)[:80]!r}); an environment returns a str (a tool "
                        "message), a dict with 'role' and 'content' (and optionally 'reward', 'done'), or None (done)")
    reward = out.get("reward")
    if reward is not None:
        value = finite_number(reward)
        if value is None:
            raise ValueError(f"returned reward {reward!r:.60}: a turn's reward is a finite number")
        reward = value
    done = out.get("done", False)
    if not isinstance(done, bool):
        raise TypeError(f"returned done {done!r:.60}: 'done' is true or false")
    if done:
        return None, reward
    if not (isinstance(out.get("role"), str) and "content" in out):
        raise TypeError(f"returned a dict without 'role' and 'content' (keys {sorted(map(str, out))}) and without "
                        "'done': true; an observation is a message, or the trajectory is done")
    content = out["content"]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)  # OpenAI text parts, joined as a data row's
    if not isinstance(content, str):  # a number was never cut, and 0 rendered as nothing
        raise TypeError(f"returned a message whose content is a {type(content).__name__} ({str(content)[:60]!r}); "
                        "an observation's content is text (or a list of text parts): str(...) it")
    return {**{k: v for k, v in out.items() if k not in ("reward", "done")}, "content": content}, reward


def cut_observation(tokenizer, content: str, limit: int, side: str = "middle") -> str:
    """``content`` cut to ``limit`` of its tokens, as verl cuts a tool response
    (``tool_response_truncate_side``): "left" keeps its start (+ "...(truncated)"), "right" its
    end ("(truncated)..." +), "middle" both ends (half each, "...(truncated)..." between);
    as is when it fits. The cut is on the content, before the chat template wraps it, so the
    next assistant turn's generation prompt is never cut off; and between characters (a kept
    part is the content's own text: a byte-level token boundary inside a character would
    decode to U+FFFD), so a part may keep a few tokens fewer than its share."""
    if side not in ("left", "middle", "right"):
        raise ValueError(f"truncate side {side!r}: one of left, middle, right")
    enc = tokenizer.tok.encode(content, add_special_tokens=False)
    n, at = len(enc.ids), enc.offsets  # each token's characters (a character's bytes: all its own)
    if n <= limit:
        return content

    def head(k: int) -> str:  # the characters before the first token past k (a character it splits: out)
        return content[:at[k][0]] if k > 0 else ""

    def tail(k: int) -> str:  # the characters after the last token before the final k
        return content[at[n - k - 1][1]:] if k > 0 else ""

    if side == "left":
        return head(limit) + "...(truncated)"
    if side == "right":
        return "(truncated)..." + tail(limit)
    return head(limit // 2) + "...(truncated)..." + tail(limit - limit // 2)


def observation_ids(tokenizer, message: dict) -> list[int]:
    """Token ids of an observation as the chat template renders it after an assistant turn, ending
    with the next assistant turn's generation prompt (the text the template adds for ``message``
    after a conversation, taken past an empty system turn); without a template, its content as is."""
    if not tokenizer.chat_template:
        return tokenizer.encode(message["content"], add_special_tokens=False)
    before = tokenizer.apply_chat_template([_SYSTEM], add_generation_prompt=False)
    after = tokenizer.apply_chat_template([_SYSTEM, message], add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError(f"the tokenizer's chat template renders [system] as {before[-80:]!r}, which is not the "
                         f"start of its rendering of [system, {message.get('role')}] ({after[:120]!r}): the "
                         "observation's tokens cannot be taken from it")
    return tokenizer.encode(after[len(before):], add_special_tokens=False)
