"""`grpolab demo --agent`'s data and starting policy: the chat template, the two agent tasks, the
scripted (deliberately imperfect) transcripts π0 is SFT'd on, and `build_agent_pi0`.

The two tasks, both from agents/builtin.py, trained from the same π0:
- the tool task: CalculatorTask (multiply two CALC_DIGITS-digit numbers; reward 1 for the exact
  product) with this module's `calculator` tool; a tiny model cannot multiply in its head, so it must
  call the tool, copy the operands into a well-formed call and copy the result back. The tool replies
  like a calculator's display, "913 * 753 = 687489": the value follows " = ", an anchor the model can
  find (copying a number that only follows the tool turn's header is learned far less reliably);
- the multi-turn task: GuessNumber (a secret in [1, GUESS_N], GUESS_TURNS guesses, replies
  "higher" / "lower" with the interval they leave: "higher, 6 to 9"); bisection solves every game
  (2.8 guesses on average), counting up from 1 only the secrets up to GUESS_TURNS (3.5 guesses).

π0 is SFT'd on transcripts that use the tool only sometimes (most restate the expression and write a
guessed product), whose calls are sometimes flawed (malformed JSON, a wrong tool name or argument, a
mistyped operand), and whose guesses are partly bisection and partly a habit that ignores the
replies (counting up from 1). GRPO has to find the better behaviours among π0's own samples.

Items are {"seed": int}. Held-out items use seeds 0 .. n-1 (`heldout_items`); training items are
drawn from [TRAIN_SEED_BASE, 2**31) (`training_items`), so the two never meet.
"""

from __future__ import annotations

import random
import re
import time
from typing import Any, Callable

from grpolab.agents import builtin
from grpolab.agents.agent import AgentSpec
from grpolab.agents.builtin import last_integer

CHAT_TEMPLATE = (  # compact ChatML: one short system line names the tools; a tool result is a "tool" turn
    "{%- if tools %}{{ '<|im_start|>system\ntools: ' + (tools | map(attribute='function.name') | join(', '))"
    " + '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
"""Reads `tools` (agents.toolcall.template_supports_tools: native tool format): the tool schemas
become the line "tools: calculator", and tool results {"role": "tool"} render as a ChatML turn of
their own. Every message renders on its own, so environment replies are appends (agents/delta.py)."""

CALCULATOR = "grpolab.app.demo_agent_data:calculator"
CALC_DIGITS = 3
GUESS_N = 9
GUESS_TURNS = 6
TRAIN_SEED_BASE = 10**6
HELDOUT_ITEMS = 200


WORDS = (
    "<tool_call>", "</tool_call>", '{"name":"', '","arguments":{"', '":"', '"}}', "calculator", "expression",
    "system", "user", "assistant", "tool", "tools: ", " * ", "What is ", "Guess my number between 1 and ",
    ": I say higher, lower or correct. ", " guesses.", "higher", "lower", "correct", " to ", ", ", " = ",
)
"""Whole-word tokens of the demo's tokenizer: the chat template's and the tasks' fixed text and the
call format's JSON, so a transcript is a few dozen tokens and only numbers are spelled digit by digit
(the model copies operands into the call and the tool's result into its answer digit by digit)."""


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression on integers (+ - * / and parentheses); returns it with its value.

    Args:
        expression: The expression, e.g. "913 * 753".
    """
    return f"{expression.strip()} = {builtin.calculator(expression)}"


def chat_tokenizer():
    """The character-level ChatML tokenizer (models/tiny_chat.py) with WORDS and the demo's CHAT_TEMPLATE."""
    from grpolab.models.tiny_chat import build_char_chat_tokenizer

    return build_char_chat_tokenizer(CHAT_TEMPLATE, words=WORDS)


def calculator_spec(digits: int = CALC_DIGITS) -> AgentSpec:
    """The tool task: CalculatorTask with the calculator tool; a call turn, an answer turn, one spare."""
    return AgentSpec(environment="grpolab.agents.builtin:CalculatorTask", environment_kwargs={"digits": digits},
                     tools=(CALCULATOR,), max_turns=3, max_episode_tokens=512, max_turn_tokens=96)


def guess_spec(n: int = GUESS_N, turns: int = GUESS_TURNS, turn_cost: float = 0.05) -> AgentSpec:
    """The multi-turn task: GuessNumber in [1, n] with `turns` guesses (the driver allows as many)."""
    return AgentSpec(environment="grpolab.agents.builtin:GuessNumber",
                     environment_kwargs={"n": n, "max_turns": turns, "turn_cost": turn_cost, "hint": True},
                     max_turns=turns, max_episode_tokens=512, max_turn_tokens=6)


def heldout_items(n: int = HELDOUT_ITEMS) -> list[dict[str, int]]:
    """The evaluation items: seeds 0 .. n-1 (never drawn for training)."""
    return [{"seed": s} for s in range(n)]


def training_items(n: int, seed: int, salt: str = "") -> list[dict[str, int]]:
    """n training items with distinct seeds drawn from [TRAIN_SEED_BASE, 2**31), given (seed, salt)."""
    rng = random.Random(f"agent-train:{salt}:{seed}")
    return [{"seed": s} for s in rng.sample(range(TRAIN_SEED_BASE, 2**31), n)]


def _rng(*key: Any) -> random.Random:
    """A generator seeded by `key` (string seeding: the same on every run and platform)."""
    return random.Random(":".join(str(k) for k in key))


def tool_call_text(name: str, arguments: dict[str, str]) -> str:
    """A call in the compact <tool_call> format (agents/toolcall.py): JSON without optional spaces."""
    args = ",".join(f'"{k}":"{v}"' for k, v in arguments.items())
    return f'<tool_call>{{"name":"{name}","arguments":{{{args}}}}}</tool_call>'


def _guessed_product(a: int, b: int, rng: random.Random) -> int:
    """A wrong answer of the product's length and first digit (what a model without the tool writes)."""
    digits = str(a * b)
    while True:
        guess = int(digits[0] + "".join(rng.choice("0123456789") for _ in digits[1:]))
        if guess != a * b:
            return guess


def _flawed_call(a: int, b: int, rng: random.Random) -> str:
    """A call that goes wrong: malformed JSON, an unknown tool, a bad argument name, or a mistyped operand."""
    kind = rng.choice(("malformed", "unknown_tool", "bad_arguments", "typo"))
    if kind == "malformed":
        return tool_call_text("calculator", {"expression": f"{a} * {b}"})[: -len("}</tool_call>")] + "</tool_call>"
    if kind == "unknown_tool":
        return tool_call_text(rng.choice(("calc", "calculate", "multiply")), {"expression": f"{a} * {b}"})
    if kind == "bad_arguments":
        return tool_call_text("calculator", {rng.choice(("expr", "input", "x")): f"{a} * {b}"})
    text = str(a)
    pos = rng.randrange(len(text))
    wrong = text[:pos] + rng.choice([d for d in "0123456789" if d != text[pos] and (pos or d != "0")]) + text[pos + 1:]
    return tool_call_text("calculator", {"expression": f"{wrong} * {b}"})


class CalculatorScript:
    """π0's calculator transcripts, per item: with probability `tool` a correct call and then the
    tool's result as the answer; with `flawed` a flawed call (`_flawed_call`) and then the result if
    the call gave a number, else a guessed number; otherwise the expression restated with a guessed
    (wrong) product ("913 * 753 = 687400")."""

    def __init__(self, tool: float = 0.3, flawed: float = 0.1, salt: str = "calc"):
        self.tool, self.flawed, self.salt = tool, flawed, salt

    def __call__(self, messages: list[dict[str, Any]], item: dict[str, int]) -> str:
        found = re.search(r"(\d+) \* (\d+)", next(m["content"] for m in messages if m["role"] == "user"))
        a, b = int(found.group(1)), int(found.group(2))
        rng = _rng(self.salt, item["seed"], len(messages))
        if messages[-1]["role"] == "tool":  # the tool answered: its value, else a guess
            value = re.search(r"= (-?\d+)$", messages[-1]["content"])
            return f"{a} * {b} = {value.group(1) if value else _guessed_product(a, b, rng)}"
        choice = _rng(self.salt, "behaviour", item["seed"]).random()
        if choice < self.tool:
            return tool_call_text("calculator", {"expression": f"{a} * {b}"})
        if choice < self.tool + self.flawed:
            return _flawed_call(a, b, rng)
        return f"{a} * {b} = {_guessed_product(a, b, rng)}"


def consistent_interval(messages: list[dict[str, Any]], n: int) -> tuple[int, int]:
    """[lo, hi]: the secrets that the "higher"/"lower" replies so far leave (lo > hi: none)."""
    lo, hi = 1, n
    for guess_msg, reply in zip(messages, messages[1:]):
        if guess_msg["role"] != "assistant" or reply["role"] != "user":
            continue
        guess = last_integer(guess_msg["content"])
        if guess is not None and reply["content"].startswith("higher"):
            lo = max(lo, guess + 1)
        elif guess is not None and reply["content"].startswith("lower"):
            hi = min(hi, guess - 1)
    return lo, hi


class GuessScript:
    """π0's GuessNumber transcripts (secrets in [1, n]): each guess, independently, with probability
    `careful` the middle of the interval the replies leave (bisection: solved within log2(n) + 1
    guesses), otherwise a habit that ignores the replies: counting up, 1 first, then one more than
    the last guess (1 after n). With careful < 0.5 the habit is each turn's most likely move."""

    def __init__(self, careful: float = 0.3, n: int = GUESS_N, salt: str = "guess"):
        self.careful, self.n, self.salt = careful, n, salt

    def __call__(self, messages: list[dict[str, Any]], item: dict[str, int]) -> str:
        lo, hi = consistent_interval(messages, self.n)
        rng = _rng(self.salt, item["seed"], len(messages))
        if rng.random() < self.careful and lo <= hi:
            return str((lo + hi) // 2)
        last = last_integer(messages[-2]["content"]) if len(messages) > 1 else None
        return str(1 if last is None else last % self.n + 1)


def sft_transcripts(tokenizer, seed: int, calc_episodes: int, guess_episodes: int,
                    calc_script: CalculatorScript | None = None, guess_script: GuessScript | None = None) -> list:
    """The scripted SFT episodes of both tasks (sft.episodes.scripted_episodes) on training items."""
    from grpolab.sft.episodes import scripted_episodes

    with calculator_spec().build() as agent:
        calc = scripted_episodes(tokenizer, agent, training_items(calc_episodes, seed, "calc"),
                                 calc_script or CalculatorScript())
    with guess_spec().build() as agent:
        guess = scripted_episodes(tokenizer, agent, training_items(guess_episodes, seed, "guess"),
                                  guess_script or GuessScript())
    return calc + guess


PI0_MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "max_positions": 512}
PI0_SFT = {"steps": 1200, "batch_size": 16, "lr": 1e-3, "betas": (0.9, 0.95), "warmup_steps": 20}
PI0_DATA = {"calc_episodes": 3600, "guess_episodes": 1500}


def build_agent_pi0(seed: int, *, model_kwargs: dict | None = None, sft_kwargs: dict | None = None,
                    data_kwargs: dict | None = None, say: Callable[[str], None] | None = None):
    """π0 for `grpolab demo --agent`: a tiny char model (models/tiny.py, PI0_MODEL updated by
    model_kwargs) SFT'd on both tasks' scripted transcripts (PI0_DATA, PI0_SFT updated by data_kwargs,
    sft_kwargs). Deterministic given `seed`. Returns (model in eval mode, tokenizer)."""
    from grpolab.models.tiny import build_tiny_model
    from grpolab.rollout.hf import pad_id
    from grpolab.sft.episodes import sft_on_episodes

    tok = chat_tokenizer()
    model = build_tiny_model(tok, seed=seed, **{**PI0_MODEL, **(model_kwargs or {})})
    t0 = time.perf_counter()
    episodes = sft_transcripts(tok, seed, **{**PI0_DATA, **(data_kwargs or {})})
    sft = {**PI0_SFT, **(sft_kwargs or {})}
    if say:
        say(f"[agent-sft] {len(episodes)} scripted episodes ({time.perf_counter() - t0:.1f} s), {sft['steps']} steps")

    def on_step(step: int, loss: float) -> None:
        if say and ((step + 1) % 50 == 0 or step + 1 == sft["steps"]):
            say(f"[agent-sft] step {step + 1}/{sft['steps']} loss {loss:.4f} ({time.perf_counter() - t0:.0f} s)")

    sft_on_episodes(model, episodes, pad_id(tok), seed=seed, on_step=on_step, **sft)
    return model.eval(), tok
