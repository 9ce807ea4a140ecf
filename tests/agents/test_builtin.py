"""grpolab.agents.builtin: the calculator tool and the two built-in environments' rules."""

import pytest

from grpolab.agents.builtin import CalculatorTask, GuessNumber, calculator, last_integer


@pytest.mark.parametrize("expression, value", [
    ("4821 * 7390", "35627190"),
    ("2 + 3 * 4", "14"),
    ("(2 + 3) * 4", "20"),
    ("-5 - -3", "-2"),
    ("+7", "7"),
    ("12 / 4", "3"),
    ("1 / 3", "0.3333333333"),
    (" 10 - 2 * (3 + 1) ", "2"),
    ("99999999999 * 99999999999", "9999999999800000000001"),
])
def test_calculator(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, error, message", [
    ("1 / 0", ZeroDivisionError, "division by zero"),
    ("2 ** 10", ValueError, "unsupported: '2 ** 10'"),
    ("__import__('os').system('true')", ValueError, "unsupported"),
    ("x + 1", ValueError, "unsupported: 'x'"),
    ("1.5 * 2", ValueError, "unsupported: '1.5'"),
    ("True + 1", ValueError, "unsupported: 'True'"),
    ("'a' * 3", ValueError, "unsupported"),
    ("7 // 2", ValueError, "unsupported"),
    ("1 +", ValueError, "not an arithmetic expression"),
    ("1" * 201, ValueError, "longer than 200 characters"),
    ("*".join(["999999999999"] * 6), ValueError, "number too large"),
])
def test_calculator_refuses(expression, error, message):
    with pytest.raises(error, match=message.replace("*", r"\*").replace("(", r"\(")):
        calculator(expression)


def test_last_integer():
    assert last_integer("I get 12, then 35,627,190.") == 35627190
    assert last_integer("-4 and then 7") == 7 and last_integer("minus: -4") == -4
    assert last_integer("none") is None


def test_calculator_task_is_deterministic_with_four_digit_operands():
    env = CalculatorTask()
    first = env.reset({"seed": 7})
    a, b = env.operands
    assert 1000 <= a <= 9999 and 1000 <= b <= 9999 and env.answer == a * b
    assert first == [{"role": "user", "content": f"What is {a} * {b}?"}]
    assert CalculatorTask().reset({"seed": 7}) == first
    assert CalculatorTask().reset({"seed": 8}) != first
    assert CalculatorTask(digits=2).reset({"a": 12, "b": 34})[0]["content"].startswith("What is 12 * 34?")


def test_calculator_task_rewards_the_exact_product():
    env = CalculatorTask()
    env.reset({"a": 1234, "b": 5678})
    assert env.step({"role": "assistant", "content": "The answer is 7,006,652."}) == ([], 1.0, True)
    env.reset({"a": 1234, "b": 5678})
    assert env.step({"role": "assistant", "content": "7006652 or maybe 7006653"}) == ([], 0.0, True)
    with pytest.raises(ValueError, match="expected an item"):
        env.reset({"question": 1})


def test_guess_number_secret_is_deterministic_and_in_range():
    secrets = []
    for seed in range(50):
        env = GuessNumber(n=20)
        env.reset({"seed": seed})
        assert 1 <= env.secret <= 20
        secrets.append(env.secret)
    again = GuessNumber(n=20)
    again.reset({"seed": 3})
    assert again.secret == secrets[3] and len(set(secrets)) > 5


def _play(env, guesses):
    return [env.step({"role": "assistant", "content": g}) for g in guesses]


def test_guess_number_replies_and_reward():
    env = GuessNumber(n=100, max_turns=5)
    assert "between 1 and 100" in env.reset({"secret": 37})[0]["content"]
    steps = _play(env, ["50", "I guess 25", "no idea", "37"])
    assert [s[0][0]["content"] for s in steps] == ["lower", "higher", "Reply with a number.", "correct"]
    assert [s[1] for s in steps] == [None, None, None, 1.0] and [s[2] for s in steps] == [False, False, False, True]


def test_guess_number_hint_names_the_interval_the_replies_leave():
    env = GuessNumber(n=16, max_turns=6, hint=True)
    env.reset({"secret": 11})
    steps = _play(env, ["8", "14", "3", "no idea", "12", "11"])  # "3" and "12" ignore the hint: it stays
    assert [s[0][0]["content"] for s in steps] == ["higher, 9 to 16", "lower, 9 to 13", "higher, 9 to 13",
                                                   "Reply with a number.", "lower, 9 to 11", "correct"]
    env.reset({"secret": 2})  # reset starts over from [1, n]
    assert _play(env, ["4"])[0][0][0]["content"] == "lower, 1 to 3"


def test_guess_number_out_of_turns_and_turn_cost():
    env = GuessNumber(max_turns=2)
    env.reset({"secret": 10})
    assert _play(env, ["5", "6"])[-1] == ([{"role": "user", "content": "higher"}], 0.0, True)
    env = GuessNumber(max_turns=4, turn_cost=0.1)
    env.reset({"secret": 10})
    assert _play(env, ["5", "20", "10"])[-1][1:] == (pytest.approx(0.8), True)
    env.reset({"secret": 10})  # reset starts over
    assert _play(env, ["10"])[0][1] == 1.0


def test_guess_number_bad_settings():
    with pytest.raises(ValueError, match="turn_cost"):
        GuessNumber(max_turns=5, turn_cost=0.5)
