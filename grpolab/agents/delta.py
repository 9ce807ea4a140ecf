"""Token-exact appends: the ids the chat template adds after a policy turn, encoded once.

Token in, token out: an episode's ids are the prompt's, then the policy's sampled ids as sampled,
then each environment turn's ids, and so on. The policy's ids are never decoded and re-encoded
(decoding is used only to hand the environment the text of a turn). An environment turn's ids are
the chat template's rendering DELTA: the template is rendered as text for the history (ending with
the policy's turn) and for history + new messages + the next generation prompt, and only the text
the longer rendering adds is encoded. Rendering as text and comparing is what detects a template
that cannot be appended to (one that rewrites earlier turns, e.g. drops the reasoning of previous
assistant turns): `TemplateNotAppendable`, naming the message and the first differing position.

The turn boundary. The policy's turn ends with its end-of-turn token (its EOS, e.g. <|im_end|>),
which the template renders as the end of the assistant message; that token is the policy's, the
last of its sampled ids. Whatever the template puts after it, before the next message (ChatML: the
"\\n" after <|im_end|>), belongs to the environment delta, as does the generation prompt that opens
the next assistant turn ("<|im_start|>assistant\\n"). So, in text:

    B = render(history[:-1])                         the messages before the policy's turn
    H = render(history)                              B + header + content + <end> + tail ("\\n")
    L = render(history + new, generation prompt)     H + the new messages + the generation prompt
    delta = tail + L[len(H):]

Checked: H starts with B; H's last <end> comes after B, right after the assistant's content
(whitespace aside); L starts with H. How the template renders the policy's own turn before its
<end> does not matter (Qwen2.5 drops the "\\n" after the header of an empty turn, a thinking
template may add tags): the policy's ids are kept as sampled, only the text after <end> is used.
"""

from __future__ import annotations

from typing import Any, Sequence

Message = dict[str, Any]


class TemplateNotAppendable(ValueError):
    """The chat template cannot express an episode's next turn as an append to what came before.

    message_index: the message (of the longer conversation) whose rendering differs, or None;
    position: the first differing character of the two renderings; shorter, longer: the renderings.
    """

    def __init__(self, reason: str, message_index: int | None, position: int, shorter: str, longer: str):
        self.reason, self.message_index, self.position = reason, message_index, position
        self.shorter, self.longer = shorter, longer
        lo = max(0, position - 40)
        where = f"message {message_index}" if message_index is not None else "an unknown message"
        super().__init__(
            f"chat template not appendable: {reason} (at {where}, character {position}):\n"
            f"  before: ...{shorter[lo : position + 40]!r}\n  after:  ...{longer[lo : position + 40]!r}"
        )


def render(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict] | None = None,
           add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (tools: JSON schemas for the template's `tools=`)."""
    return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                         add_generation_prompt=add_generation_prompt, tokenize=False)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, no special tokens added (the template writes its own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: Any, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
    """An episode's first ids: the opening messages rendered with the generation prompt, encoded."""
    return encode_text(tokenizer, render(tokenizer, messages, tools, add_generation_prompt=True))


def control_tokens(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into special (control) tokens wherever they appear in text."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted(t for t in found if t)


def first_difference(a: str, b: str) -> int:
    """The first index where `a` and `b` differ (len of the shorter when one is a prefix of the other)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def env_delta_ids(tokenizer: Any, history: Sequence[Message], new_messages: Sequence[Message],
                  tools: Sequence[dict] | None = None, end_of_turn: str | None = None) -> list[int]:
    """The ids the template adds for `new_messages` and the next generation prompt after `history`.

    history: the episode's messages so far, the last one the policy's {"role": "assistant"} turn
    (its content: the decoded sampled ids, end-of-turn token excluded). new_messages: the
    environment's (or tools') messages; their content must not contain control-token text.
    end_of_turn: the text of the policy's end-of-turn token (default: tokenizer.eos_token).
    Returns the delta's ids [D] (see the module docstring). Raises TemplateNotAppendable when the
    template cannot express the turn as an append, ValueError for control-token text.
    """
    history, new_messages = list(history), list(new_messages)
    if not history or history[-1].get("role") != "assistant":
        raise ValueError("env_delta_ids: history must end with the policy's assistant message")
    _check_no_control_text(tokenizer, new_messages, len(history))
    end, last = end_of_turn or tokenizer.eos_token, len(history) - 1
    before = render(tokenizer, history[:-1], tools) if len(history) > 1 else ""
    shorter = render(tokenizer, history, tools)
    if not shorter.startswith(before):
        pos = first_difference(before, shorter)
        raise TemplateNotAppendable("adding the assistant turn changes how earlier messages are rendered",
                                    _message_at(tokenizer, history[:-1], pos, tools), pos, before, shorter)
    stop = shorter.rfind(end)
    if stop < len(before) or not _squash(shorter[len(before) : stop]).endswith(_squash(history[-1]["content"])):
        raise TemplateNotAppendable(f"the assistant turn is not rendered as its content then {end!r} (the "
                                    "policy's end-of-turn token)", last, len(before), before, shorter)
    longer = render(tokenizer, history + new_messages, tools, add_generation_prompt=True)
    if not longer.startswith(shorter):
        pos = first_difference(shorter, longer)
        raise TemplateNotAppendable("adding the new messages changes how earlier messages are rendered",
                                    _message_at(tokenizer, history, pos, tools), pos, shorter, longer)
    return encode_text(tokenizer, shorter[stop + len(end) :] + longer[len(shorter) :])


def _squash(text: Any) -> str:
    """`text` without whitespace (templates may strip or re-space a turn's content)."""
    return "".join(str(text).split())


def _check_no_control_text(tokenizer: Any, messages: Sequence[Message], offset: int) -> None:
    for i, m in enumerate(messages):
        content = str(m.get("content", ""))
        for tok in control_tokens(tokenizer):
            if tok in content:
                raise ValueError(f"env_delta_ids: new message {offset + i} contains the control token text {tok!r}, "
                                 "which would be encoded as that token; remove it (see strip_control_text)")


def strip_control_text(tokenizer: Any, text: str) -> str:
    """`text` with every control token's text removed (for text the policy can influence, e.g. tool output)."""
    tokens = control_tokens(tokenizer)
    while any(tok in text for tok in tokens):  # until stable: a removal may join two halves of a token
        for tok in tokens:
            text = text.replace(tok, "")
    return text


def _message_at(tokenizer: Any, messages: Sequence[Message], pos: int, tools: Sequence[dict] | None) -> int | None:
    """The first message k whose rendering (of messages[:k+1]) reaches past character `pos`."""
    for k in range(1, len(messages) + 1):
        try:
            if len(render(tokenizer, messages[:k], tools)) > pos:
                return k - 1
        except Exception:  # noqa: BLE001 - templates may refuse some prefixes (e.g. no user message yet)
            continue
    return None
