"""(prompt, response) pairs for SFT from the user's files: JSONL or a local HF dataset.

A row is EITHER a prompt (field `prompt_field`) with its response (field `response_field`), OR chat
messages (field `messages_field`) ending with the assistant's reply, which is the response; the
messages before it are the prompt. Prompts are rendered exactly as GRPO renders them
(`sources.row_to_item`: chat template, system prompt), so SFT trains the policy on the text it will
be prompted with. The loss covers the response tokens (and EOS) only (`sft.sft`).
Errors name the file and line (or dataset row), among them a prompt or response the model's tokenizer
cannot encode (the character named), found when the data loads, before any step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

from grpolab.data.sources import RenderOptions, dataset_rows, encode_text, jsonl_rows, row_to_item


def row_to_pair(row: Any, where: str, opts: RenderOptions, response_field: str) -> tuple[str, str]:
    """One row -> (prompt text, response text); ValueError prefixed with `where`."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    messages = row.get(opts.messages_field)
    if messages is not None and row.get(opts.prompt_field) is None:  # a chat: the last message is the response
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not isinstance(last, Mapping) or last.get("role") != "assistant":
            raise ValueError(f"{where}: field {opts.messages_field!r} must end with the assistant's reply "
                             "(the response to train on)")
        prompt = row_to_item({opts.messages_field: messages[:-1]}, where, opts).prompt
        response = last.get("content")
    else:
        prompt = row_to_item({k: v for k, v in row.items() if k != response_field}, where, opts).prompt
        if response_field not in row:
            raise ValueError(f"{where}: has {opts.prompt_field!r} but no {response_field!r} (the response to "
                             f"train on; data.response_field names it); fields: {', '.join(map(str, row))}")
        response = row[response_field]
    if not isinstance(response, str) or not response.strip():
        raise ValueError(f"{where}: the response must be a non-empty string, got {response!r}"[:200])
    if opts.tokenizer is not None:  # the prompt was checked by row_to_item
        encode_text(opts.tokenizer, response, f"{where}: the response")
    return prompt, response


def load_sft_pairs(
    source: str,
    *,
    response_field: str = "response",
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    tokenizer: Any = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> list[tuple[str, str]]:
    """The pairs of data.source 'jsonl:PATH' or 'hf:PATH' (a local dataset's train split)."""
    kind, _, path = source.partition(":")
    rows: Iterable[tuple[str, Any]]
    if kind == "jsonl":
        rows = jsonl_rows(Path(path), "SFT data file")
    elif kind == "hf":
        rows = dataset_rows(Path(path).expanduser())
    else:
        raise ValueError(f"data.source={source!r}: SFT reads jsonl:PATH or hf:PATH (or builtin:arith)")
    opts = RenderOptions(prompt_field=prompt_field, messages_field=messages_field, tokenizer=tokenizer,
                         system_prompt=system_prompt, use_chat_template=use_chat_template)
    pairs = [row_to_pair(row, where, opts, response_field) for where, row in rows]
    if not pairs:
        raise ValueError(f"data.source={source!r}: no (prompt, response) pairs (the data is empty)")
    return pairs
