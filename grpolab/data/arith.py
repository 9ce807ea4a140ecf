"""The built-in task: integer arithmetic prompts, some of them unanswerable (the right answer is a refusal).

Prompts and completions
-----------------------
An answerable prompt is `<a><op><b>=` with op in `+ - * /`, e.g. `"37+45="`; its completion is the
exact integer answer (`"82"`), then EOS. With `pad_operands=True` (default) operands are zero-padded
to the width of their op's largest operand (`"07+45="`, `"056/08="`), so digits line up; answers are
never padded. Ranges: `+`: a, b in 0..add_max; `-`: a, b in 0..sub_max with a >= b (non-negative
results) unless `sub_negative=True` (then every pair, answers like `"-5"`); `*`: a, b in 0..mul_max;
`/`: divisor b in 1..div_max and quotient q in 0..div_max, dividend a = b*q (exact results only).

Unanswerable prompts have the completion `REFUSAL` (`"cannot"`), then EOS. Kinds (`unanswerable_kinds`):
- `"div_by_zero"`: `"<a>/0="` for a in 0..div_max**2 (also when "/" is not among the answerable `ops`);
- `"missing_operand"`: `"<a><op>="` or `"<op><b>="` (one operand left out), operands in the op's range;
- `"unknown_operand"`: `"?<op><b>="` or `"<a><op>?="` (off by default).

The train / held-out split
--------------------------
The fact space is finite and enumerated. Every prompt has a split key naming its fact:
`"+|a|b"`, `"-|a|b"`, `"*|a|b"`, `"/|a|b"` for answerable facts, `"div_by_zero|a"`,
`"missing_right|<op>|a"`, `"missing_left|<op>|b"`, `"unknown_right|<op>|a"`, `"unknown_left|<op>|b"`
for unanswerable ones. With `commuted_together=True` (default) the key of `+` and `*` facts uses the
unordered pair (min, max), so "3*7" and "7*3" are always on the same side: a held-out fact's swapped
twin is never trained on. (Set it to False to split ordered pairs independently: easier, but the
held-out "3*7" may then be learned from a trained "7*3".) A fact is held out iff

    int.from_bytes(blake2b(f"{seed}:{key}", digest_size=8), "big") / 2**64 < eval_fraction

so the split depends only on (seed, key): not on the op ranges, on enumeration order, or on how
many prompts are drawn, and it is the same in every process. Division "a/b" and division by zero
"a/0" have different keys, so each unanswerable form is split independently of the answerable ones.
`train_prompts` (GRPO) and `sft_examples` (SFT) draw only from the train side; `eval_items` draws only
from the held-out side. tests/data/test_arith.py checks the disjointness over the whole fact space.

Sampling
--------
Answerable prompts: op uniform over `ops`, then a fact uniform within that op. Unanswerable prompts:
kind uniform over the usable kinds, then op uniform, then a prompt uniform. Training draws are with
replacement; evaluation items are distinct (drawn round-robin over ops/kinds, without replacement).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Sequence

REFUSAL = "cannot"
OPS = "+-*/"
ANSWERABLE_KIND = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
UNANSWERABLE_KINDS = ("div_by_zero", "missing_operand", "unknown_operand")
BUILTIN_SFT_EXAMPLES = 4000
"""SFT examples drawn from the task when sft.examples is None."""
EVAL, TRAIN = "eval", "train"


@dataclass(frozen=True)
class PromptItem:
    """One prompt and its metadata: answer (str, or None if unanswerable), answerable, op, kind."""

    prompt: str
    meta: dict[str, Any] = field(hash=False)
    messages: tuple[dict[str, str], ...] | None = field(default=None, hash=False, compare=False)
    """The chat messages the prompt was rendered from (a prompt row: one user message; the system
    prompt first when data.system_prompt set one), for agent episodes, which render them themselves;
    None for sources without messages (builtin:arith, builtin:seeds)."""


def target_completion(meta: dict[str, Any]) -> str:
    """The correct completion text (without EOS): the answer, or REFUSAL for an unanswerable prompt."""
    return meta["answer"] if meta["answerable"] else REFUSAL


def split_of(key: str, seed: int, eval_fraction: float) -> str:
    """TRAIN or EVAL for the fact with split key `key` (see the module docstring)."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return EVAL if int.from_bytes(digest, "big") / 2**64 < eval_fraction else TRAIN


@dataclass(frozen=True)
class ArithTask:
    """Knobs of the arithmetic task, and its samplers. All sampling is driven by explicit seeds/RNGs."""

    seed: int = 0
    """Seed of the train/held-out split (only of the split; samplers take their own RNG)."""
    ops: str = OPS
    """Operations used, a subset of "+-*/"."""
    add_max: int = 99
    sub_max: int = 99
    mul_max: int = 12
    div_max: int = 12
    """Largest divisor and quotient (dividends up to div_max**2)."""
    sub_negative: bool = False
    """Allow a < b in "a-b" (negative answers); False keeps subtraction results >= 0."""
    pad_operands: bool = True
    """Zero-pad operands to their op's width ("07+45=")."""
    commuted_together: bool = True
    """Split "a+b"/"b+a" and "a*b"/"b*a" by one key, so both are on the same side."""
    eval_fraction: float = 0.2
    """Share of the fact space held out for evaluation (per fact, by the seeded hash)."""
    unanswerable_share: float = 0.25
    """Share of unanswerable prompts in GRPO prompt batches and in eval_items."""
    unanswerable_kinds: tuple[str, ...] = ("div_by_zero", "missing_operand")
    answer_lsb_first: bool = False
    """Write answers least-significant digit first ("37+45=" -> "28", i.e. 82 reversed): the order
    in which small transformers learn carrying quickly (Lee et al. 2023, "Teaching arithmetic to
    small transformers"). Refusals are unaffected."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "unanswerable_kinds", tuple(self.unanswerable_kinds))
        if not self.ops or any(o not in OPS for o in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ArithTask.ops must be distinct characters of {OPS!r}, got {self.ops!r}")
        for name in ("add_max", "sub_max", "mul_max", "div_max"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ArithTask.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"ArithTask.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.unanswerable_share <= 1.0:
            raise ValueError(f"ArithTask.unanswerable_share must be in [0, 1], got {self.unanswerable_share}")
        bad = [k for k in self.unanswerable_kinds if k not in UNANSWERABLE_KINDS]
        if bad:
            raise ValueError(f"ArithTask.unanswerable_kinds: unknown {bad}; known: {list(UNANSWERABLE_KINDS)}")
        if self.unanswerable_share > 0 and not self._unanswerable_groups():
            raise ValueError(
                f"ArithTask: unanswerable_share={self.unanswerable_share} but unanswerable_kinds="
                f"{self.unanswerable_kinds} give no prompts for ops={self.ops!r}"
            )

    # ---- the fact space -------------------------------------------------------------------------

    def _operand_range(self, op: str, side: str) -> range:
        if op == "/":
            return range(0, self.div_max**2 + 1) if side == "left" else range(1, self.div_max + 1)
        top = {"+": self.add_max, "-": self.sub_max, "*": self.mul_max}[op]
        return range(0, top + 1)

    def _fmt(self, x: int, op: str, side: str) -> str:
        if not self.pad_operands:
            return str(x)
        return str(x).zfill(len(str(self._operand_range(op, side)[-1])))

    def _prompt(self, a: int | str | None, op: str, b: int | str | None) -> str:
        left = self._fmt(a, op, "left") if isinstance(a, int) else (a or "")
        right = self._fmt(b, op, "right") if isinstance(b, int) else (b or "")
        return f"{left}{op}{right}="

    def _answerable(self, op: str) -> Iterator[tuple[str, PromptItem]]:
        meta = {"answerable": True, "op": op, "kind": ANSWERABLE_KIND[op]}
        if op == "/":
            for b in self._operand_range("/", "right"):
                for q in range(0, self.div_max + 1):
                    a = b * q
                    yield f"/|{a}|{b}", PromptItem(self._prompt(a, op, b), {**meta, "answer": self._answer(q)})
            return
        for a in self._operand_range(op, "left"):
            for b in self._operand_range(op, "right"):
                if op == "-" and a < b and not self.sub_negative:
                    continue
                value = {"+": a + b, "-": a - b, "*": a * b}[op]
                pair = (min(a, b), max(a, b)) if self.commuted_together and op in "+*" else (a, b)
                yield f"{op}|{pair[0]}|{pair[1]}", PromptItem(self._prompt(a, op, b), {**meta, "answer": self._answer(value)})

    def _answer(self, value: int) -> str:
        return reverse_digits(str(value)) if self.answer_lsb_first else str(value)

    def _unanswerable(self, kind: str, op: str) -> Iterator[tuple[str, PromptItem]]:
        meta = {"answer": None, "answerable": False, "op": op, "kind": kind}
        if kind == "div_by_zero":
            zero = self._fmt(0, "/", "right")
            for a in self._operand_range("/", "left"):
                yield f"div_by_zero|{a}", PromptItem(f"{self._fmt(a, '/', 'left')}/{zero}=", dict(meta))
            return
        filler, tag = ("", "missing") if kind == "missing_operand" else ("?", "unknown")
        for a in self._operand_range(op, "left"):
            yield f"{tag}_right|{op}|{a}", PromptItem(self._prompt(a, op, filler), dict(meta))
        for b in self._operand_range(op, "right"):
            yield f"{tag}_left|{op}|{b}", PromptItem(self._prompt(filler, op, b), dict(meta))

    def _unanswerable_groups(self) -> list[tuple[str, str]]:
        """(kind, op) strata of the unanswerable prompts, in a fixed order."""
        groups = []
        for kind in self.unanswerable_kinds:
            if kind == "div_by_zero":  # available whatever the answerable ops are
                groups += [(kind, "/")]
            else:
                groups += [(kind, op) for op in self.ops]
        return groups

    @cached_property
    def _pools(self) -> dict[tuple[str, str], dict[str, list[PromptItem]]]:
        """(kind, op) -> {TRAIN: [...], EVAL: [...]}, in enumeration order."""
        pools: dict[tuple[str, str], dict[str, list[PromptItem]]] = {}
        sources = [((ANSWERABLE_KIND[op], op), self._answerable(op)) for op in self.ops]
        sources += [((k, op), self._unanswerable(k, op)) for k, op in self._unanswerable_groups()]
        for group, items in sources:
            pool: dict[str, list[PromptItem]] = {TRAIN: [], EVAL: []}
            for key, item in items:
                pool[split_of(key, self.seed, self.eval_fraction)].append(item)
            pools[group] = pool
        return pools

    def items(self, split: str) -> list[PromptItem]:
        """Every prompt of one side of the split (TRAIN or EVAL), in a fixed order."""
        if split not in (TRAIN, EVAL):
            raise ValueError(f"ArithTask.items: split must be {TRAIN!r} or {EVAL!r}, got {split!r}")
        return [_copy(item) for pool in self._pools.values() for item in pool[split]]

    # ---- samplers -------------------------------------------------------------------------------

    def _strata(self, answerable: bool) -> list[list[tuple[str, str]]]:
        """Groups of (kind, op) strata: one group per op (answerable) or per kind (unanswerable)."""
        if answerable:
            return [[(ANSWERABLE_KIND[op], op)] for op in self.ops]
        by_kind: dict[str, list[tuple[str, str]]] = {}
        for kind, op in self._unanswerable_groups():
            by_kind.setdefault(kind, []).append((kind, op))
        return list(by_kind.values())

    def _draw_train(self, rng: random.Random, answerable: bool) -> PromptItem:
        group = rng.choice(self._strata(answerable))
        stratum = rng.choice(group)
        pool = self._pools[stratum][TRAIN]
        if not pool:
            raise ValueError(
                f"ArithTask: no training prompts of kind/op {stratum}; lower eval_fraction or widen the range"
            )
        return _copy(rng.choice(pool))

    def _draw_refusal(self, rng: random.Random, kinds: Sequence[str] | None) -> PromptItem:
        if kinds is None:
            return self._draw_train(rng, False)
        strata = [(k, op) for k, op in self._unanswerable_groups() if k in kinds]
        if not strata:
            raise ValueError(f"sft_examples: refusal_kinds={tuple(kinds)} match none of unanswerable_kinds="
                             f"{self.unanswerable_kinds}")
        return rng.choice(self._pools[rng.choice(strata)][TRAIN])

    def train_prompts(self, rng: random.Random, n: int) -> list[PromptItem]:
        """n training-side prompts for GRPO (with replacement), about `unanswerable_share` unanswerable.

        The unanswerable count is n*share rounded stochastically (exact share in expectation).
        """
        n_un = _stochastic_round(rng, n * self.unanswerable_share)
        items = [self._draw_train(rng, True) for _ in range(n - n_un)]
        items += [self._draw_train(rng, False) for _ in range(n_un)]
        rng.shuffle(items)
        return items

    def eval_items(self, n: int, seed: int = 0) -> list[PromptItem]:
        """n distinct held-out prompts: round(n*unanswerable_share) unanswerable, the rest answerable.

        Deterministic in (task, n, seed). Items are spread evenly over ops (answerable) and over
        kinds, then ops (unanswerable); a stratum that runs out leaves its turn to the others.
        """
        rng = random.Random(seed)
        n_un = round(n * self.unanswerable_share)
        out = []
        for answerable, count in ((True, n - n_un), (False, n_un)):
            groups = []
            for group in self._strata(answerable):
                pools = [rng.sample(self._pools[s][EVAL], len(self._pools[s][EVAL])) for s in group]
                groups.append(_round_robin(pools))
            picked = _round_robin(groups)[:count]
            if len(picked) < count:
                what = "answerable" if answerable else "unanswerable"
                raise ValueError(
                    f"ArithTask.eval_items: asked for {count} {what} items, only {len(picked)} are held out; "
                    "ask for fewer, or raise eval_fraction / the operand ranges"
                )
            out += [_copy(it) for it in picked]
        rng.shuffle(out)
        return out

    def sft_examples(
        self,
        rng: random.Random,
        n: int,
        *,
        refusal_examples: int | float = 0.02,
        answer_noise: float = 0.0,
        refusal_kinds: Sequence[str] | None = None,
    ) -> list[tuple[str, str]]:
        """n (prompt, completion) SFT pairs from the training side; completions without EOS.

        refusal_examples: an int is a count, a float in [0, 1] a share of n (rounded) of unanswerable
            prompts with the completion REFUSAL. Keep it small so that π0 refuses only sometimes.
        answer_noise: share (rounded) of the answerable examples whose answer is replaced by a
            plausible wrong one (off by 1 or 10, or two digits swapped): a "noisy teacher".
        refusal_kinds: the unanswerable kinds the refusal examples are drawn from (None = all of
            `unanswerable_kinds`), e.g. ("div_by_zero",): π0 then refuses only some kinds of
            unanswerable prompts and GRPO has the others left to learn.
        """
        if isinstance(refusal_examples, bool) or not isinstance(refusal_examples, (int, float)):
            raise ValueError(
                f"sft_examples: refusal_examples must be an int count or a float share, got {refusal_examples!r}"
            )
        if isinstance(refusal_examples, int):
            if not 0 <= refusal_examples <= n:
                raise ValueError(f"sft_examples: refusal_examples={refusal_examples} must be in [0, n={n}]")
            n_ref = refusal_examples
        else:
            if not 0.0 <= refusal_examples <= 1.0:
                raise ValueError(f"sft_examples: refusal_examples share must be in [0, 1], got {refusal_examples}")
            n_ref = round(n * refusal_examples)
        if not 0.0 <= answer_noise <= 1.0:
            raise ValueError(f"sft_examples: answer_noise must be in [0, 1], got {answer_noise}")
        if n_ref and not self._unanswerable_groups():
            raise ValueError("sft_examples: refusal examples asked for, but the task has no unanswerable kinds")
        answerable = [self._draw_train(rng, True) for _ in range(n - n_ref)]
        noisy = set(rng.sample(range(len(answerable)), round(len(answerable) * answer_noise)))
        pairs = [
            (it.prompt, wrong_answer(rng, it.meta["answer"], self.answer_lsb_first) if i in noisy else it.meta["answer"])
            for i, it in enumerate(answerable)
        ]
        pairs += [(self._draw_refusal(rng, refusal_kinds).prompt, REFUSAL) for _ in range(n_ref)]
        rng.shuffle(pairs)
        return pairs


def wrong_answer(rng: random.Random, answer: str, lsb_first: bool = False) -> str:
    """A plausible wrong integer for `answer`: its value off by ±1 or ±10, two adjacent digits
    swapped, or one digit replaced by another (a kind drawn uniformly, then a candidate of it).

    lsb_first: `answer` is written least-significant digit first (ArithTask.answer_lsb_first); the
    wrong value is written the same way, so every digit position, the units too, can be the wrong one.
    Never equal to `answer`; never negative when `answer` is not; no leading zero.
    """
    written = reverse_digits(answer) if lsb_first else answer
    sign, msb = ("-", written[1:]) if written.startswith("-") else ("", written)
    value = int(written)
    offsets = {str(value + d) for d in (-10, -1, 1, 10)}
    swaps = {sign + msb[:i] + msb[i + 1] + msb[i] + msb[i + 2 :] for i in range(len(msb) - 1)}
    replaced = {sign + msb[:i] + d + msb[i + 1 :] for i in range(len(msb)) for d in "0123456789" if d != msb[i]}

    def ok(c: str) -> bool:
        body = c.lstrip("-")
        return c != sign + msb and (value < 0 or not c.startswith("-")) and (body == "0" or body[0] != "0") \
            and c != "-0"

    kinds = [sorted(c for c in group if ok(c)) for group in (offsets, swaps, replaced)]
    pick = rng.choice(rng.choice([k for k in kinds if k]))
    return reverse_digits(pick) if lsb_first else pick


def reverse_digits(text: str) -> str:
    """An integer's digits in the other order, the sign kept in front: "-123" <-> "-321"."""
    sign, digits = ("-", text[1:]) if text.startswith("-") else ("", text)
    return sign + digits[::-1]


def _copy(item: PromptItem) -> PromptItem:
    """A copy with its own meta dict, so callers may annotate it without touching the task's pools."""
    return PromptItem(item.prompt, dict(item.meta))


def _stochastic_round(rng: random.Random, x: float) -> int:
    base = math.floor(x)
    return base + (1 if rng.random() < x - base else 0)


def _round_robin(pools: Sequence[Sequence[Any]]) -> list[Any]:
    """Interleaves the pools: one item from each in turn, skipping those that ran out."""
    out, i = [], 0
    longest = max((len(p) for p in pools), default=0)
    while i < longest:
        out += [p[i] for p in pools if i < len(p)]
        i += 1
    return out
