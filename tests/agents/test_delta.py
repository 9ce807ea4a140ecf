"""grpolab.agents.delta: environment turns as exact template deltas; templates that cannot be appended to."""

import pytest

from agents_chat import DROP_REASONING_TEMPLATE, build_chat_tokenizer
from grpolab.agents.delta import (
    TemplateNotAppendable,
    control_tokens,
    env_delta_ids,
    first_difference,
    prompt_ids,
    render,
    strip_control_text,
)

OPENING = [{"role": "system", "content": "S"}, {"role": "user", "content": "Guess."}]


def _episode_ids(tok, messages, reply, new):
    """prompt ids + the policy's turn (its text encoded, then EOS) + the delta, and the history used."""
    history = messages + [{"role": "assistant", "content": reply}]
    policy = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    return prompt_ids(tok, messages) + policy + env_delta_ids(tok, history, new), history


def test_delta_is_the_template_text_after_the_policy_end_token(chat_tok):
    history = OPENING + [{"role": "assistant", "content": "50"}]
    new = [{"role": "user", "content": "higher"}]
    delta = env_delta_ids(chat_tok, history, new)
    # "\n" after <|im_end|> is the environment's; so is the next generation prompt
    assert delta == chat_tok.encode("\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)


def test_prompt_policy_and_delta_spell_the_full_rendering(chat_tok):
    ids, history = _episode_ids(chat_tok, OPENING, "50", [{"role": "user", "content": "higher"}])
    full = render(chat_tok, history + [{"role": "user", "content": "higher"}], add_generation_prompt=True)
    assert ids == chat_tok.encode(full, add_special_tokens=False)


def test_no_new_messages_gives_just_the_tail_and_the_generation_prompt(chat_tok):
    history = OPENING + [{"role": "assistant", "content": "50"}]
    expected = chat_tok.encode("\n<|im_start|>assistant\n", add_special_tokens=False)
    assert env_delta_ids(chat_tok, history, []) == expected


def test_tool_messages_with_a_tools_template(tools_tok):
    schema = {"type": "function", "function": {"name": "calc"}}
    history = OPENING + [{"role": "assistant", "content": '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'}]
    new = [{"role": "tool", "name": "calc", "content": "6"}]
    delta = env_delta_ids(tools_tok, history, new, tools=[schema])
    expected = "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert delta == tools_tok.encode(expected, add_special_tokens=False)
    assert '"calc"' in render(tools_tok, OPENING, [schema])  # the schemas reached the template


def test_a_template_that_drops_earlier_reasoning_is_not_appendable():
    tok = build_chat_tokenizer(DROP_REASONING_TEMPLATE)
    history = OPENING + [{"role": "assistant", "content": "<think>about 50</think>\n50"}]
    with pytest.raises(TemplateNotAppendable) as info:
        env_delta_ids(tok, history, [{"role": "user", "content": "higher"}])
    err = info.value
    assert err.message_index == 2  # the assistant turn whose rendering changed
    assert err.shorter[err.position:].startswith("<think>about 50</think>")
    assert err.longer[err.position:].startswith("50<|im_end|>")
    assert "message 2, character" in str(err) and "changes how earlier messages are rendered" in str(err)
    # without reasoning the same template appends fine
    history[-1] = {"role": "assistant", "content": "50"}
    env_delta_ids(tok, history, [{"role": "user", "content": "higher"}])


def test_a_template_that_rewrites_the_assistant_content_is_named():
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
                "{{ (m['content'] | upper) if m['role'] == 'assistant' else m['content'] }}{{ '<|im_end|>\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = build_chat_tokenizer(template)
    with pytest.raises(TemplateNotAppendable, match=r"not rendered as its content then '<\|im_end\|>'") as info:
        env_delta_ids(tok, OPENING + [{"role": "assistant", "content": "fifty"}], [])
    assert info.value.message_index == 2


def test_how_the_policy_turn_itself_is_rendered_does_not_matter():
    """Qwen2.5 writes no "\\n" after the header of an empty assistant turn, unlike its generation prompt:
    the policy's ids are kept as sampled, and the delta after its end token is still exact."""
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] }}{% if m['content'] %}{{ '\n' + m['content'] }}"
                "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = build_chat_tokenizer(template)
    for content in ("", "50"):
        history = OPENING + [{"role": "assistant", "content": content}]
        delta = env_delta_ids(tok, history, [{"role": "user", "content": "higher"}])
        assert tok.decode(delta) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_messages_when_the_turn_is_added_is_named():
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                "{% if m['role'] == 'user' and not loop.last %}{{ ' (answered)' }}{% endif %}{{ '<|im_end|>\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = build_chat_tokenizer(template)
    with pytest.raises(TemplateNotAppendable, match="adding the assistant turn changes") as info:
        env_delta_ids(tok, OPENING + [{"role": "assistant", "content": "50"}], [])
    assert info.value.message_index == 1 and info.value.shorter[info.value.position:] == "<|im_end|>\n"


def test_end_of_turn_other_than_eos():
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_start|>\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = build_chat_tokenizer(template)
    history = OPENING + [{"role": "assistant", "content": "50"}]
    with pytest.raises(TemplateNotAppendable, match="'<\\|im_end\\|>'"):
        env_delta_ids(tok, history, [])
    assert env_delta_ids(tok, history, [], end_of_turn="<|im_start|>") == tok.encode(
        "\n<|im_start|>assistant\n", add_special_tokens=False)


def test_control_token_text_in_new_messages_is_refused(chat_tok):
    history = OPENING + [{"role": "assistant", "content": "50"}]
    with pytest.raises(ValueError, match="new message 3 contains the control token text '<\\|im_end\\|>'"):
        env_delta_ids(chat_tok, history, [{"role": "user", "content": "x<|im_end|>y"}])
    assert control_tokens(chat_tok) == ["<bos>", "<pad>", "<|im_end|>", "<|im_start|>"]
    assert strip_control_text(chat_tok, "a<|im_<|im_end|>end|>b<pad>") == "ab"


def test_history_must_end_with_the_assistant(chat_tok):
    with pytest.raises(ValueError, match="history must end with the policy's assistant message"):
        env_delta_ids(chat_tok, OPENING, [])


def test_first_difference():
    assert first_difference("abc", "abd") == 2 and first_difference("ab", "abc") == 2 and first_difference("", "x") == 0
