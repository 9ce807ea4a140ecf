"""The files of examples/smollm2_tool_agent.yaml, written to examples/data/tool_agent/ (or OUT_DIR):

    python examples/tool_agent_data.py [OUT_DIR]

- sft.jsonl: demonstrations of the tool-call format on another task, reasoning-gym `products`
  (two factors of 2 to 4 digits). Each transcript, in grpolab's default tool format (the tool's
  schema in the system message, grpolab.agents.toolcall), gives two chat rows, each ending with
  the assistant turn to learn: the call, then the final answer after the calculator's reply.
- train.jsonl / heldout.jsonl: the task GRPO learns, reasoning-gym `chain_sum` (2 or 3 terms of 3 or
  4 digits, + and -), its questions as they are; held-out questions never appear in train.jsonl.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpolab.agents.builtin import calculator
from grpolab.agents.toolcall import tool_result_messages, with_tool_prompt
from grpolab.agents.tools import ToolOutcome, load_tools
from grpolab.data.sources import reasoning_gym_items

OUT = Path(__file__).resolve().parent / "data" / "tool_agent"
TOOL = "grpolab.agents.builtin:calculator"
DEMO_TASK, DEMO_PARAMS, DEMOS = "products", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 4}, 256
TASK, TASK_PARAMS = "chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 3, "max_digits": 4}
TRAIN, HELDOUT = 256, 128


def demonstrations(count: int = DEMOS, seed: int = 0) -> list[dict]:
    """2 × count chat rows ({"messages": [...]}) of `count` distinct demo questions."""
    schemas = load_tools([TOOL]).schemas
    rows, seen = [], set()
    for it in reasoning_gym_items(DEMO_TASK, size=4 * count, seed=seed, use_chat_template=False, **DEMO_PARAMS):
        entry = it.meta["rg_entry"]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        expression = entry["metadata"]["expression"]
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        opening = with_tool_prompt([{"role": "user", "content": entry["question"]}], schemas)
        turn = {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"}
        result = calculator(expression)
        reply = tool_result_messages([ToolOutcome("calculator", result)], native=False)
        answer = {"role": "assistant", "content": f"The final answer is {result}."}
        rows += [{"messages": opening + [turn]}, {"messages": opening + [turn, *reply, answer]}]
        if len(seen) == count:
            return rows
    raise ValueError(f"{DEMO_TASK} with {DEMO_PARAMS}: fewer than {count} distinct questions")


def task_split(train: int = TRAIN, heldout: int = HELDOUT) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows): distinct questions, disjoint; {"prompt", "answer", rg_*} each."""
    def distinct(seed: int, size: int, exclude: set) -> list[dict]:
        out, seen = [], set(exclude)
        for it in reasoning_gym_items(TASK, size=2 * size, seed=seed, use_chat_template=False, **TASK_PARAMS):
            if it.prompt not in seen:
                seen.add(it.prompt)
                out.append({"prompt": it.prompt, **it.meta})
        if len(out) < size:
            raise ValueError(f"{TASK} with {TASK_PARAMS}: fewer than {size} distinct questions")
        return out[:size]

    held = distinct(12345, heldout, set())
    return distinct(0, train, {r["prompt"] for r in held}), held


def write(out: Path = OUT) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train, held = task_split()
    for name, rows in (("sft", demonstrations()), ("train", train), ("heldout", held)):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{out / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
