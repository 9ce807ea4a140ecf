"""Prompt sources for real tasks: JSONL files, local HF datasets, reasoning-gym tasks.

Each returns `list[PromptItem]`: the prompt text exactly as the policy will see it, and a meta dict
for the reward functions (e.g. `answer`).

Rows: each row has EITHER a prompt string (field `prompt_field`, default "prompt") OR chat
messages (field `messages_field`, default "messages": a list of {"role", "content"}). Every other
field goes to meta unchanged (e.g. {"prompt": "2+3?", "answer": "5"} -> meta {"answer": "5"}).

Chat template: when a tokenizer with a chat template is given (and `use_chat_template` is True),
prompts and messages are rendered with `apply_chat_template(..., add_generation_prompt=True,
tokenize=False)`; a plain prompt becomes one user message. `system_prompt` is put first when the
row has no system message of its own. With system_prompt=None the template decides, and some
insert a default: SmolLM2's adds "You are a helpful AI assistant named SmolLM, trained by Hugging
Face". Pass a system prompt (it may be "") to control that. Without a template a prompt string is
used as is, and chat messages are an error.

Errors name the file and line (or dataset row): missing file, a line that is not JSON, a row that
is not an object, no prompt/messages field, an empty prompt, malformed messages, and (with
`max_prompt_tokens`) a rendered prompt longer than that many tokens; with a tokenizer, a prompt it cannot
encode (`encode_text`: the character named).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from grpolab.data.arith import PromptItem
from grpolab.optional import require


@dataclass(frozen=True)
class RenderOptions:
    """How a row becomes prompt text (shared by every source)."""

    prompt_field: str = "prompt"
    messages_field: str = "messages"
    tokenizer: Any = None
    system_prompt: str | None = None
    use_chat_template: bool = True
    max_prompt_tokens: int | None = None

    def templated(self) -> bool:
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        return self.use_chat_template and self.tokenizer is not None and has_template


def chat_messages(content: str | list[dict[str, str]], opts: RenderOptions) -> list[dict[str, str]]:
    """The prompt as chat messages: a string as one user message; the system prompt first when
    opts.system_prompt is set and the messages have none."""
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else list(content)
    if opts.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": opts.system_prompt}] + messages
    return messages


def render_prompt(content: str | list[dict[str, str]], opts: RenderOptions) -> str:
    """A prompt string or a list of chat messages -> the prompt text (see the module docstring).

    Raises ValueError (without location; callers add it) for messages that cannot be rendered.
    """
    if not opts.templated():
        if isinstance(content, str):
            return content
        raise ValueError("has chat messages but no tokenizer with a chat template was given")
    return opts.tokenizer.apply_chat_template(chat_messages(content, opts), add_generation_prompt=True, tokenize=False)


def check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be an object with string 'role' and 'content', got {m!r}"[:200])
    if messages[-1]["role"] == "assistant":
        raise ValueError("the last message is the assistant's; a prompt must end before the reply")
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise ValueError("messages have no non-empty user content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _ids(tokenizer: Any, text: str) -> list[int] | None:
    """The ids of `text`, or None when `tokenizer` raises on it or gives its unknown token."""
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - tokenizers raise their own types (e.g. a missing [UNK])
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    return None if unk is not None and unk in ids and (tokenizer.unk_token or "") not in text else ids


def encode_text(tokenizer: Any, text: str, what: str) -> list[int]:
    """The token ids of `text` (no special tokens added). A text the tokenizer cannot encode (a character
    outside a character-level tokenizer's alphabet, or one it maps to its unknown token) is a ValueError
    naming `what` (e.g. "data.jsonl:7: field 'response'"), the first such character, its code point and
    its position."""
    ids = _ids(tokenizer, text)
    if ids is not None:
        return ids
    for pos, ch in enumerate(text):
        if _ids(tokenizer, ch) is None:
            raise ValueError(f"{what}: the model's tokenizer cannot encode the character {ch!r} (U+{ord(ch):04X}) "
                             f"at position {pos}: {text[max(0, pos - 30):pos + 30]!r}; remove it from the data or "
                             "use a model whose tokenizer has it")
    raise ValueError(f"{what}: the model's tokenizer cannot encode this text: {text[:80]!r}")


def row_to_item(row: Any, where: str, opts: RenderOptions) -> PromptItem:
    """One row (a dict) -> PromptItem; `where` (e.g. "data.jsonl:7") prefixes every error."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    pf, mf = opts.prompt_field, opts.messages_field
    has_prompt, has_messages = row.get(pf) is not None, row.get(mf) is not None
    if has_prompt == has_messages:
        what = "both" if has_prompt else "neither"
        raise ValueError(f"{where}: needs exactly one of the fields {pf!r} or {mf!r}, has {what} "
                         f"(fields: {', '.join(map(str, row)) or 'none'})")
    try:
        if has_prompt:
            content = row[pf]
            if not isinstance(content, str):
                raise ValueError(f"field {pf!r} must be a string, got {type(content).__name__}")
            if not content.strip():
                raise ValueError(f"field {pf!r} is empty")
        else:
            content = check_messages(row[mf])
        text = render_prompt(content, opts)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if opts.tokenizer is not None:
        n = len(encode_text(opts.tokenizer, text, f"{where}: the prompt"))
        if opts.max_prompt_tokens is not None and n > opts.max_prompt_tokens:
            raise ValueError(
                f"{where}: the prompt is {n} tokens long, more than max_prompt_tokens={opts.max_prompt_tokens}"
            )
    meta = {k: v for k, v in row.items() if k not in (pf, mf)}
    return PromptItem(prompt=text, meta=meta, messages=tuple(chat_messages(content, opts)))


def _options(**kw: Any) -> RenderOptions:
    opts = RenderOptions(**kw)
    if opts.max_prompt_tokens is not None and opts.tokenizer is None:
        raise ValueError("max_prompt_tokens needs a tokenizer to count tokens")
    return opts


def load_jsonl(
    path: str | os.PathLike,
    *,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    tokenizer: Any = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
) -> list[PromptItem]:
    """Prompts from a JSONL file, one JSON object per line (blank lines skipped)."""
    opts = _options(prompt_field=prompt_field, messages_field=messages_field, tokenizer=tokenizer,
                    system_prompt=system_prompt, use_chat_template=use_chat_template,
                    max_prompt_tokens=max_prompt_tokens)
    path = Path(path)
    items = [row_to_item(row, where, opts) for where, row in jsonl_rows(path, "prompt file")]
    if not items:
        raise ValueError(f"{path}: no prompts (the file is empty)")
    return items


def jsonl_rows(path: Path, what: str = "file"):
    """("PATH:LINE", row) for each non-blank line of a JSONL file; errors name the file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None


_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def open_local_dataset(path: Path, split: str, cache_dir: str | None) -> Any:
    datasets = require("datasets", "tasks")
    saved = any((path / f).is_file() for f in ("dataset_dict.json", "dataset_info.json", "state.json"))
    try:
        if path.is_dir() and saved:  # written by save_to_disk
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"no split {split!r} (splits: {', '.join(ds)})")
                ds = ds[split]
            return ds
        if path.is_file():
            builder = _BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ValueError(f"unknown file type {path.suffix!r} (known: {', '.join(_BUILDERS)})")
            return datasets.load_dataset(builder, data_files=str(path), split=split, cache_dir=cache_dir)
        return datasets.load_dataset(str(path), split=split, cache_dir=cache_dir)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"dataset {path} (split {split!r}): {e}") from None


def _is_repo_id(text: str) -> bool:
    """'org/name': one slash, neither part empty or a path step (not ./x, ../x, /x, ~/x)."""
    org, sep, name = text.partition("/")
    return bool(sep and org and name and "/" not in name and org not in (".", "..", "~") and not text.startswith("/"))


def hub_dataset_folder(repo_id: str) -> Path:
    """The local snapshot of hub dataset `repo_id` in the Hugging Face cache (HF_HOME / HF_HUB_CACHE), as
    `datasets.load_dataset` downloaded it; fetched when missing unless HF_HUB_OFFLINE=1. FileNotFoundError
    naming the id when it is neither cached nor reachable."""
    require("huggingface_hub", "tasks")
    from grpolab.hub import hub_folder

    return hub_folder(repo_id, "dataset")


def dataset_rows(path: Path, split: str = "train", cache_dir: str | None = None):
    """("PATH[split] row I", row) for each row of a local dataset (see `load_hf_dataset`), or of hub dataset
    'org/name' from the Hugging Face cache (`hub_dataset_folder`) when no local path has that name."""
    where = path
    if not path.exists() and _is_repo_id(str(path)):
        path = hub_dataset_folder(str(path))
    elif not path.exists():
        raise FileNotFoundError(f"dataset {str(path)!r} not found locally (a file, a folder, or a hub id org/name "
                                "in the Hugging Face cache)")
    for i, row in enumerate(open_local_dataset(path, split, cache_dir)):
        yield f"{where}[{split}] row {i}", row


def load_hf_dataset(
    path: str | os.PathLike,
    split: str = "train",
    *,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    tokenizer: Any = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    cache_dir: str | None = None,
) -> list[PromptItem]:
    """Prompts from a dataset via `datasets`: a .json/.jsonl/.parquet/.arrow/.csv file, a folder of such
    files, a folder written by `save_to_disk`, or a hub id 'org/name' already in the Hugging Face cache
    (`hub_dataset_folder`; HF_HUB_OFFLINE=1 keeps it offline).

    A single file holds one split, "train". Rows follow the same rules as `load_jsonl`.
    """
    opts = _options(prompt_field=prompt_field, messages_field=messages_field, tokenizer=tokenizer,
                    system_prompt=system_prompt, use_chat_template=use_chat_template,
                    max_prompt_tokens=max_prompt_tokens)
    p = Path(path).expanduser()
    items = [row_to_item(row, where, opts) for where, row in dataset_rows(p, split, cache_dir)]
    if not items:
        raise ValueError(f"dataset {p} (split {split!r}) has no rows")
    return items


def reasoning_gym_items(
    name: str,
    *,
    size: int,
    seed: int,
    tokenizer: Any = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
    **params: Any,
) -> list[PromptItem]:
    """`size` prompts of the reasoning-gym task `name` (`create_dataset(name, size, seed, **params)`).

    The raw question goes through the chat template. meta: "answer" (the task's oracle answer,
    when it has one), "rg_task" (name), "rg_params" (params), "rg_entry" (the whole entry: the
    verifier passes it to the task's own `score_answer`).
    """
    rg = require("reasoning_gym", "tasks")
    try:
        dataset = rg.create_dataset(name, size=size, seed=seed, **params)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning-gym task {name!r} with {params}: {e}") from None
    opts = RenderOptions(tokenizer=tokenizer, system_prompt=system_prompt, use_chat_template=use_chat_template)
    items = []
    for i in range(size):
        entry = dataset[i]
        meta = {"rg_task": name, "rg_params": dict(params), "rg_entry": entry}
        if entry.get("answer") is not None:
            meta["answer"] = entry["answer"]
        items.append(PromptItem(prompt=render_prompt(entry["question"], opts), meta=meta))
    return items
