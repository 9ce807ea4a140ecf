"""app/demo_agent_data.py: the demo's calculator tool and π0's scripted calculator answers."""

from __future__ import annotations

import pytest

from grpolab.app.demo_agent_data import CalculatorScript, calculator, tool_call_text

USER = [{"role": "user", "content": "What is 913 * 753?"}]


def test_the_demo_calculator_shows_the_expression_with_its_value():
    assert calculator(" 913 * 753 ") == "913 * 753 = 687489"
    assert calculator("7 / 2") == "7 / 2 = 3.5"
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculator("913 *")


@pytest.mark.parametrize("reply, answer", [
    ("913 * 753 = 687489", "913 * 753 = 687489"),
    ("973 * 753 = 732669", "913 * 753 = 732669"),  # a mistyped operand: the tool's (wrong) value is used
])
def test_the_script_answers_with_the_tool_value(reply, answer):
    call = tool_call_text("calculator", {"expression": "913 * 753"})
    messages = USER + [{"role": "assistant", "content": call}, {"role": "tool", "content": reply}]
    assert CalculatorScript()(messages, {"seed": 5}) == answer


def test_after_a_tool_error_the_script_guesses_a_wrong_product_of_the_right_shape():
    messages = USER + [{"role": "assistant", "content": "<tool_call>{}</tool_call>"},
                       {"role": "tool", "content": "Error: malformed tool call"}]
    head, value = CalculatorScript()(messages, {"seed": 5}).split(" = ")
    assert head == "913 * 753" and value != "687489" and len(value) == 6 and value[0] == "6"


def test_first_turns_mix_calls_flawed_calls_and_restated_guesses():
    turns = [CalculatorScript(tool=0.3, flawed=0.1)(USER, {"seed": s}) for s in range(400)]
    good = tool_call_text("calculator", {"expression": "913 * 753"})
    calls = sum(t == good for t in turns)
    flawed = sum(t.startswith("<tool_call>") and t != good for t in turns)
    restated = sum(t.startswith("913 * 753 = ") for t in turns)
    assert calls + flawed + restated == 400
    assert 0.22 < calls / 400 < 0.38 and 0.05 < flawed / 400 < 0.16  # binomial, n = 400: ±4 standard deviations
