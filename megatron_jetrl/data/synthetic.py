"""Verifiable synthetic tasks with their own character vocabulary, so the whole RL loop runs offline.

A task makes prompts, a reference solution per prompt (the supervised warm-up target) and a
strict 0/1 verifier. Text is ASCII and tokenized one character per token by ``CharTokenizer``;
one fixed vocabulary serves every task, so a checkpoint trained on one task loads for another.

Text layout (the prompt ends where the response begins; the trainer appends ``<eos>``):

    countdown    prompt "3 5 7>22="    solution "3*5+7"    answer {"numbers": [3, 5, 7], "target": 22}
    arithmetic   prompt "12*34="       solution "408"      answer 408
    chain        prompt "07>"          solution "84 01 58" answer {"seed": 7, "length": 3}

Scoring is strict and never raises on model output: the whole response (surrounding whitespace
aside) must be the answer, so trailing text after a correct answer scores 0. Countdown responses
are parsed by a small recursive-descent parser over exact fractions, never ``eval``.

``chain`` is the long-response task (the mismatch study's task): from a two-digit seed, ``length``
iterates of the fixed map x -> (21 x + 37) mod 100, 3 x length - 1 characters of response. Each
entry follows from the previous one, so one early mistake spoils the rest, as in a long chain of
reasoning; it scores the fraction of entries correct before the first wrong one (partial credit
keeps the reward dense at 100+ tokens), 1.0 only for the whole answer. A small model learns the map
in a short warm-up (the study's starting point); sampling at temperature 1 still errs somewhere in
a long answer, which RL then trains away. (A running-sum task, where each entry also needs the
matching prompt number, stayed at chance after the 19 M-parameter study model's 300-step warm-up.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping, Optional, Sequence

from megatron_jetrl.config import ConfigError

class OutOfVocabulary(ValueError):
    """Text with a character the synthetic tasks' character tokenizer does not have."""


MAX_RESPONSE_CHARS = 64
"""Longer responses (after stripping whitespace) score 0 unread; this also bounds the countdown
parser's recursion depth."""

_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = "0123456789+-*/()= <>,.:;?!abcdefghijklmnopqrstuvwxyz"
_UNKNOWN = "\ufffd"


@dataclass(frozen=True)
class CharTokenizer:
    """One token per character over a fixed vocabulary: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2,
    then the characters of ``_CHARS`` in order (``vocab_size`` = 3 + len(_CHARS)).

    ``decode`` drops special tokens and maps an id outside the vocabulary to U+FFFD instead of
    raising: Megatron pads the output layer (to a multiple of 128), so an untrained policy can
    sample such an id, and the response should then just score 0.
    """

    chars: str = _CHARS
    chat_template: Optional[str] = None

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def bos_token_id(self) -> int:
        return 1

    @property
    def eos_token_id(self) -> int:
        return 2

    @property
    def vocab_size(self) -> int:
        return len(_SPECIALS) + len(self.chars)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` prepends ``<bos>`` (HF's keyword)."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for i, ch in enumerate(text):
            k = self.chars.find(ch)
            if k < 0:
                raise OutOfVocabulary(f"character {ch!r} at position {i} of {text[:40]!r} is not in the synthetic "
                                      f"vocabulary {self.chars!r}")
            ids.append(len(_SPECIALS) + k)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped (or spelled out if not ``skip_special_tokens``)."""
        out = []
        for i in ids:
            i = int(i)
            if 0 <= i < len(_SPECIALS):
                if not skip_special_tokens:
                    out.append(_SPECIALS[i])
            elif len(_SPECIALS) <= i < self.vocab_size:
                out.append(self.chars[i - len(_SPECIALS)])
            else:
                out.append(_UNKNOWN)
        return "".join(out)


TOKENIZER = CharTokenizer()


# ---------------------------------------------------------------- options


def _int_option(options: Mapping[str, object], key: str, name: str, lo: int, hi: int) -> int:
    v = options[name]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(f"{key}.{name}", v, f"must be an integer in [{lo}, {hi}]")
    return v


def _ops_option(options: Mapping[str, object], key: str, allowed: str) -> str:
    v = options["ops"]
    if not isinstance(v, str) or not v or any(c not in allowed for c in v):
        raise ConfigError(f"{key}.ops", v, f"must be a non-empty string of operators from {allowed!r}")
    return "".join(sorted(set(v), key=allowed.index))


# ---------------------------------------------------------------- countdown

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


def _apply(op: str, a: Fraction, b: Fraction) -> Optional[Fraction]:
    """``a op b``, or None for division by zero."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 else a / b


def _random_expression(rng: random.Random, nums: list[int], ops: str) -> tuple[str, int, Optional[Fraction]]:
    """A random binary expression tree over ``nums`` in the given order, printed with minimal
    parentheses: (text, precedence of its top operator (3 for a leaf), value or None)."""
    if len(nums) == 1:
        return str(nums[0]), 3, Fraction(nums[0])
    k = rng.randint(1, len(nums) - 1)
    op = rng.choice(ops)
    lt, lp, lv = _random_expression(rng, nums[:k], ops)
    rt, rp, rv = _random_expression(rng, nums[k:], ops)
    if lp < _PREC[op]:
        lt = f"({lt})"
    if rp < _PREC[op] or (rp == _PREC[op] and op in "-/"):
        rt = f"({rt})"
    value = None if lv is None or rv is None else _apply(op, lv, rv)
    return f"{lt}{op}{rt}", _PREC[op], value


def _countdown_options(options: Mapping[str, object], key: str) -> dict:
    lo = _int_option(options, key, "min_number", 0, 999)
    return {"num_numbers": _int_option(options, key, "num_numbers", 2, 6), "min_number": lo,
            "max_number": _int_option(options, key, "max_number", lo, 999), "ops": _ops_option(options, key, "+-*/")}


def _countdown_generate(rng: random.Random, options: Mapping[str, object]) -> dict:
    n, lo, hi, ops = options["num_numbers"], options["min_number"], options["max_number"], options["ops"]
    for _ in range(10_000):
        nums = [rng.randint(lo, hi) for _ in range(n)]
        text, _, value = _random_expression(rng, nums, ops)
        if value is not None and value.denominator == 1 and value >= 0:
            shown = nums[:]
            rng.shuffle(shown)
            target = int(value)
            return {"prompt": f"{' '.join(map(str, shown))}>{target}=",
                    "answer": {"numbers": shown, "target": target}, "solution": text}
    raise ValueError("no non-negative integer target found in 10000 draws; widen the number range or add '+' "
                     "or '*' to ops")


class _Parser:
    """Recursive descent over ``expr := term (('+'|'-') term)*``, ``term := factor (('*'|'/') factor)*``,
    ``factor := number | '(' expr ')'``; no unary minus. Raises ValueError on any malformed input
    (including division by zero); records the numbers it reads."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.numbers: list[int] = []

    def parse(self) -> Fraction:
        value = self.expr()
        self.skip()
        if self.i != len(self.s):
            raise ValueError("trailing text")
        return value

    def skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def peek(self) -> str:
        self.skip()
        return self.s[self.i] if self.i < len(self.s) else ""

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            value = self.binary(op, value, self.term())
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.s[self.i]
            self.i += 1
            value = self.binary(op, value, self.factor())
        return value

    def factor(self) -> Fraction:
        c = self.peek()
        if c == "(":
            self.i += 1
            value = self.expr()
            if self.peek() != ")":
                raise ValueError("unbalanced parenthesis")
            self.i += 1
            return value
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in "0123456789":
            self.i += 1
        digits = self.s[start:self.i]
        if not digits or (len(digits) > 1 and digits[0] == "0"):
            raise ValueError("expected a number")
        self.numbers.append(int(digits))
        return Fraction(int(digits))

    @staticmethod
    def binary(op: str, a: Fraction, b: Fraction) -> Fraction:
        value = _apply(op, a, b)
        if value is None:
            raise ValueError("division by zero")
        return value


def _countdown_score(text: str, answer: Mapping[str, object]) -> float:
    parser = _Parser(text)
    try:
        value = parser.parse()
    except ValueError:
        return 0.0
    if sorted(parser.numbers) != sorted(answer["numbers"]):
        return 0.0
    return 1.0 if value == answer["target"] else 0.0


# ---------------------------------------------------------------- arithmetic


def _arithmetic_options(options: Mapping[str, object], key: str) -> dict:
    return {"digits": _int_option(options, key, "digits", 1, 9), "ops": _ops_option(options, key, "+-*")}


def _arithmetic_generate(rng: random.Random, options: Mapping[str, object]) -> dict:
    digits, ops = options["digits"], options["ops"]
    a, b = rng.randint(0, 10**digits - 1), rng.randint(0, 10**digits - 1)
    op = rng.choice(ops)
    value = int(_apply(op, Fraction(a), Fraction(b)))
    return {"prompt": f"{a}{op}{b}=", "answer": value, "solution": str(value)}


def _arithmetic_score(text: str, answer: int) -> float:
    return 1.0 if text == str(int(answer)) else 0.0


# ---------------------------------------------------------------- chain

CHAIN_MULTIPLIER, CHAIN_INCREMENT = 21, 37
"""x -> (21 x + 37) mod 100 has full period (Hull–Dobell): every seed walks all 100 values."""
CHAIN_MAX_LENGTH = 64


def _chain_options(options: Mapping[str, object], key: str) -> dict:
    return {"length": _int_option(options, key, "length", 2, CHAIN_MAX_LENGTH)}


def _chain_generate(rng: random.Random, options: Mapping[str, object]) -> dict:
    seed = rng.randint(0, 99)
    return {"prompt": f"{seed:02d}>", "answer": {"seed": seed, "length": options["length"]},
            "solution": " ".join(f"{x:02d}" for x in _chain(seed, options["length"]))}


def _chain(seed: int, length: int) -> list[int]:
    out, x = [], seed
    for _ in range(length):
        x = (CHAIN_MULTIPLIER * x + CHAIN_INCREMENT) % 100
        out.append(x)
    return out


def _chain_score(text: str, answer: Mapping[str, int]) -> float:
    expected = [f"{x:02d}" for x in _chain(int(answer["seed"]), int(answer["length"]))]
    got = text.split(" ")
    if len(got) > len(expected):
        return 0.0
    correct = 0
    for g, e in zip(got, expected, strict=False):  # a short response is scored up to its end
        if g != e:
            break
        correct += 1
    return correct / len(expected)


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class SyntheticTask:
    """A named task: ``generate`` makes records, ``score`` verifies a response against a record's
    ``answer`` (as stored, or after a JSON round trip)."""

    name: str
    defaults: Mapping[str, object]
    check_options: Callable[[Mapping[str, object], str], Mapping[str, object]]
    """(merged options, their config key) -> the options normalised; a ConfigError names the option."""
    make_record: Callable[[random.Random, Mapping[str, object]], dict]
    """Raises ValueError when the options allow no record (``generate`` names the options' key)."""
    verify: Callable[[str, object], float]
    """(stripped response of at most ``max_response_chars``, answer) -> a score in [0, 1] (1.0 or
    0.0 but for chain's partial credit)."""
    max_response_chars: int = MAX_RESPONSE_CHARS
    """Longer responses score 0 unread."""

    def tokenizer(self) -> CharTokenizer:
        return TOKENIZER

    def generate(self, size: int, seed: int, *, options_key: str = "synthetic.options", **options: object
                 ) -> list[dict]:
        """``size`` records ``{"prompt", "answer", "solution"}``, a pure function of (size, seed,
        options); the first k records of a larger ``size`` equal those of ``size`` = k. Errors in
        the options name ``options_key`` (the caller's, e.g. ``data.eval.synthetic.options``)."""
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            raise ConfigError(options_key, unknown, f"task {self.name!r} takes options {dict(self.defaults)} "
                              f"(names and defaults)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an integer >= 0; got {size!r}")
        checked = self.check_options({**self.defaults, **options}, options_key)
        rng = random.Random(f"{self.name}:{seed}")
        try:
            return [self.make_record(rng, checked) for _ in range(size)]
        except ValueError as e:
            raise ConfigError(options_key, checked, str(e)) from None

    def score(self, response: str, answer: object) -> float:
        """The task's score of ``response`` (surrounding whitespace aside): 1.0 for a correct
        answer; never raises on model output. Responses longer than ``max_response_chars`` score 0
        unread."""
        text = response.strip()
        if not text or len(text) > self.max_response_chars:
            return 0.0
        return self.verify(text, answer)


TASKS: dict[str, SyntheticTask] = {
    "countdown": SyntheticTask(
        name="countdown",
        defaults={"num_numbers": 3, "min_number": 1, "max_number": 9, "ops": "+-*"},
        check_options=_countdown_options,
        make_record=_countdown_generate,
        verify=_countdown_score,
    ),
    "arithmetic": SyntheticTask(
        name="arithmetic",
        defaults={"digits": 2, "ops": "+*"},
        check_options=_arithmetic_options,
        make_record=_arithmetic_generate,
        verify=_arithmetic_score,
    ),
    "chain": SyntheticTask(
        name="chain",
        defaults={"length": 32},
        check_options=_chain_options,
        make_record=_chain_generate,
        verify=_chain_score,
        max_response_chars=3 * CHAIN_MAX_LENGTH,
    ),
}
