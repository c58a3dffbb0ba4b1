"""Math answer checking: is the final answer of a response equal to the reference answer?

Two checkers with one signature, ``check(response, answer) -> Optional[bool]`` (None: the response
states no final answer; True/False: it does, and it is right/wrong):

- ``check_math_verify``: Hugging Face ``math_verify`` (symbolic comparison via sympy), used when
  that package is installed;
- ``check_builtin``: the last ``\\boxed{...}`` (or ``\\fbox{...}``), normalised, compared as a
  string and then as an exact rational number. Normalisation: whitespace and LaTeX spacing
  (``\\!`` ``\\,`` ``~`` ...) removed; ``\\dfrac``/``\\tfrac`` → ``\\frac``; ``\\left``/``\\right``,
  ``$``, ``%``, degrees and trailing ``\\text{...}`` units dropped, other ``\\text{x}`` → ``x``;
  ``x=5`` → ``5``; ``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt3`` → ``\\sqrt{3}``, ``a/b`` →
  ``\\frac{a}{b}``; outer braces and a trailing ``.`` dropped; ``1,000`` → ``1000``. So
  ``0.5 == \\frac{1}{2} == 1/2`` and ``1,000 == 1000``; there is no rounding tolerance.

Both only ever read the last ``MAX_RESPONSE_CHARS`` characters of a response, use no recursion and
no backtracking-prone patterns; they still run under ``TimedPool``'s limit, because sympy may not
be so careful. Stdlib only at import: this module is loaded by every check worker.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any, Optional

MAX_RESPONSE_CHARS = 10_000
"""Only the tail of a response is read: the final answer is at the end, and the cost is bounded."""
MAX_NUMBER_CHARS = 100

_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\ ", "\\qquad", "\\quad", "\\displaystyle", "~")
_TEXT_COMMANDS = r"\\(?:text|textbf|textrm|mathrm|mbox)"
_TRAILING_UNITS = re.compile(r"(?<=.)" + _TEXT_COMMANDS + r"\{[^{}]*\}(?:\^\{?\d\}?)?$")
_TEXT = re.compile(_TEXT_COMMANDS + r"\{([^{}]*)\}")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_EQUATION_LHS = re.compile(r"[a-zA-Z]\w?")
_DECIMAL = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_GROUPED_INT = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SIMPLE_RATIO = re.compile(r"(-?\d+)/(\d+)")
_FRAC = re.compile(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}")


def extract_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}``/``\\fbox{...}`` (braces balanced, nesting allowed)
    or ``\\boxed 5`` in the tail of ``text``; None if absent or unbalanced (a cut-off response)."""
    text = text[-MAX_RESPONSE_CHARS:]
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    j = i
    while j < len(text) and text[j] == " ":
        j += 1
    if j == len(text):
        return None
    if text[j] != "{":
        if j == i:
            return None  # \boxedfoo: another command
        end = j
        while end < len(text) and not text[end].isspace() and text[end] != "$":
            end += 1
        return text[j:end]
    depth = 0
    for k in range(j, len(text)):
        c = text[k]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[j + 1:k]
    return None


def _strip_outer_braces(s: str) -> str:
    for _ in range(8):
        if len(s) < 2 or s[0] != "{" or s[-1] != "}":
            return s
        depth = 0
        for k, c in enumerate(s):
            depth += (c == "{") - (c == "}")
            if depth == 0 and k < len(s) - 1:
                return s  # "{a}+{b}": the first brace closes early
        s = s[1:-1]
    return s


def normalize(answer: str) -> str:
    """The canonical string form of an answer (rules in the module docstring)."""
    s = answer[:MAX_RESPONSE_CHARS]
    for token in _SPACING:
        s = s.replace(token, "")
    s = re.sub(r"\s+", "", s.replace("{,}", ","))
    boxed = extract_boxed(s) if s.startswith(("\\boxed", "\\fbox")) else None
    s = boxed if boxed is not None else s
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    for token in ("^{\\circ}", "^\\circ", "\\$", "$", "\\%", "%"):
        s = s.replace(token, "")
    for _ in range(4):
        stripped = _TRAILING_UNITS.sub("", s)
        if stripped == s:
            break
        s = stripped
    s = _TEXT.sub(r"\1", s)
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if _EQUATION_LHS.fullmatch(lhs):
            s = rhs
    s = re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = _strip_outer_braces(s).rstrip(".")
    if _SIMPLE_RATIO.fullmatch(s):
        s = _SIMPLE_RATIO.sub(r"\\frac{\1}{\2}", s)
    if _GROUPED_INT.fullmatch(s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    elif s.startswith("-."):
        s = "-0" + s[1:]
    return s


def as_number(s: str) -> Optional[Fraction]:
    """A normalised answer as an exact rational (``-12``, ``0.5``, ``\\frac{3}{4}``), else None."""
    if len(s) > MAX_NUMBER_CHARS:
        return None
    if _DECIMAL.fullmatch(s):
        return Fraction(s)
    m = _FRAC.fullmatch(s)
    if m is None or not _DECIMAL.fullmatch(m.group(2)) or not _DECIMAL.fullmatch(m.group(3)):
        return None
    num, den = Fraction(m.group(2)), Fraction(m.group(3))
    if den == 0:
        return None
    return -num / den if m.group(1) else num / den


def answers_match(predicted: str, reference: str) -> bool:
    p, r = normalize(predicted), normalize(reference)
    if p == r:
        return bool(p)
    a, b = as_number(p), as_number(r)
    return a is not None and a == b


def check_builtin(response: str, answer: Any) -> Optional[bool]:
    predicted = extract_boxed(response)
    if predicted is None:
        return None
    return answers_match(predicted, str(answer))


def import_math_verify() -> None:
    """Worker initializer: pays math_verify's (sympy's, antlr's) import before the clock runs, and
    quiets its one-time "timeout is disabled" warnings (the pool enforces the limit)."""
    import math_verify  # noqa: F401

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)


def check_math_verify(response: str, answer: Any) -> Optional[bool]:
    """math_verify's parse + verify with its own signal timeouts off (the pool enforces the limit;
    its ``signal.alarm`` would cancel the pool's timer)."""
    from math_verify import parse, verify

    reference = str(answer)
    if "\\boxed" not in reference:
        reference = "\\boxed{" + reference + "}"
    predicted = parse(response[-MAX_RESPONSE_CHARS:], parsing_timeout=None)
    if not predicted:
        return None
    gold = parse(reference, parsing_timeout=None)
    if not gold:
        return check_builtin(response, answer)
    return bool(verify(gold, predicted, timeout_seconds=None))
