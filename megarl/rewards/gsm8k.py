"""Rule reward for GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems").

The response's answer is, in order of preference:

1. the number right after the first ``####`` that has one (the format the instruction asks for,
   :data:`GSM8K_INSTRUCTION`; the first, as lm-evaluation-harness's "strict-match" ``#### (\\-?[0-9\\.\\,]+)``
   with its first match, so that a model cannot list several answers; what follows the number on its line
   is ignored: ``#### 72 clips`` is 72, ``#### 5+3=8`` is 5, as there);
2. else the last ``\\boxed{...}`` (or ``\\fbox{...}``): after its last ``=`` (or ``\\approx``) when it holds
   an equation (``\\boxed{5+3=8}`` is 8, as math-verify reads it), that must be one number, optionally
   followed by a unit (``\\boxed{18 \\text{ dollars}}`` is 18), or a fraction of two numbers
   (``\\frac{16}{2}`` is 8); anything else (``\\boxed{5+3}``, ``\\boxed{2x}``, ``\\boxed{8, 9}``) is no answer;
3. else, only with ``last_number=True`` (lm-evaluation-harness's "flexible-extract", verl's "flexible"), the
   last number in the response. It is off by default: a response cut at the length limit mid-sentence often
   ends with a number of the problem itself, which would count as correct when it equals the answer.

``strict`` accepts only 1 (verl's default "strict" method reads 1 too, but takes the last ``####``).

A number is an optional sign (``-``, ``+`` or the Unicode minus; not a ``-`` right after a digit or a letter,
so ``5-3`` holds 5 and 3), an integer part and an optional decimal part ``.dd``, written as

- plain digits (``1000``), or digits grouped with one separator throughout, in one of these conventions:

  - by threes with a comma: ``1,000``, ``1,234,567``, ``-1,000``, ``$1,234`` (lm-evaluation-harness's strict
    ``#### (\\-?[0-9\\.\\,]+)`` and flexible ``(-?[$0-9.,]{2,})|(-?[0-9]+)``, and verl's ``(\\-?[0-9\\.\\,]+)``,
    all drop the commas: the same value);
  - the Indian lakh / crore grouping with a comma: the last three digits, then pairs (``1,00,000`` is 100000,
    ``12,34,56,789`` is 123456789), which the harnesses read the same way (their commas dropped);
  - either of them with LaTeX's comma ``{,}`` (``8{,}000``, ``1{,}00{,}000``; math-verify reads ``{,}``);
  - in a ``####`` or ``\\boxed{}`` answer only, by threes with a space: a plain or no-break space, a thin space
    (U+2009, U+202F) or LaTeX's ``\\,``, ``\\;``, ``\\:``, ``\\ `` or ``~`` (``1 000``, ``1\\,000``; math-verify
    accepts both separators; the harnesses read ``1 000`` as 1). LaTeX's negative space ``\\!`` is dropped
    (``1\\!,\\!000``), as math-verify does;

  with any of them, a final ``.`` ends a sentence (``#### 1,000.`` is 1000, as lm-evaluation-harness drops a final
  ``.``; verl compares ``1000.`` as a string and misses it);
- and the number must end there: a digit or a ``,``/``.``/``:`` followed by a digit right after it means it was
  not a number of this form (``1,00``, ``12,5``, ``12,34``, ``123,45,678``, ``1.000.000``, ``10:30``, ``1,0000``
  are no answer: pairs only before a last group of three, after a first group of one or two; the harnesses'
  ``[0-9.,]+`` would read ``1,00`` as 100, math-verify ``12,5`` as 12.5).

``$`` and ``\\$`` are dropped (``#### $1,234``), as are ``\\text{...}``, ``\\mbox{...}`` and ``\\mathrm{...}``
around their text. Numbers are then compared by value (:func:`normalize_number`): ``5.00``, ``+5`` and ``5``
are equal, as are ``1,000`` and ``1000`` (lm-evaluation-harness compares strings after dropping ``,``, ``$``
and a final ``.``; math-verify compares values). The ground truth is the number after the last ``####`` of the
dataset's answer (or the bare number that :func:`megarl.data.gsm8k.prepare_gsm8k` stores).

Scores (defaults): 1.0 for a correct answer; 0.1 (``format_score``) for a wrong answer stated as
``#### N``, a learning signal for small models that are rarely right (SmolLM2-135M); 0.0 otherwise.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Sequence

from megarl.rewards.registry import RewardError, register_reward

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def _number_pattern(space_groups: bool) -> str:
    """A number (module docstring): sign, integer part grouped by threes or plain, decimal part, and the end."""
    groups = (r"\d{1,3}(?:,\d{3})+|\d{1,2}(?:,\d{2})+,\d{3}"  # 1,234,567 | Indian 12,34,567
              + (r"|\d{1,3}(?: \d{3})+" if space_groups else ""))
    return (r"(?:(?<![\w)])(?P<sign>[-+]))?(?<!\d)(?<!\d[.,])"
            rf"(?P<int>(?:{groups})(?![\d])|\d+)?(?P<dec>(?(int)(?:\.\d+)?|\.\d+))(?!\d|[.,:]\d)")


_NUMBER_RE = re.compile(_number_pattern(space_groups=False))         # in running text
_ANSWER_NUMBER_RE = re.compile(_number_pattern(space_groups=True))   # in a #### or \boxed{} answer
_UNIT = r"(?:%|[A-Za-z]{2,}[A-Za-z .]*)"
_BOXED_NUMBER_RE = re.compile(rf"\s*{_ANSWER_NUMBER_RE.pattern}\s*{_UNIT}?\s*\.?\s*")
_FRACTION_RE = re.compile(r"\s*(?P<sign>[-+])?\s*\\[dt]?frac\s*\{(?P<num>[^{}]*)\}\s*\{(?P<den>[^{}]*)\}\s*\.?\s*")
_EQUALS_RE = re.compile(r"(?<![<>!=\\])=(?!=)|\\approx")
_TEXT_RE = re.compile(r"\\(?:text\w*|mbox|mathrm)\s*\{([^{}]*)\}")
_SPACE_RE = re.compile(r"\\[,;: ]|~|[\u00a0\u2009\u202f]")


def normalize_number(text: str) -> str | None:
    """The canonical decimal string of a number, or None if ``text`` is not one.

    Drops surrounding space, ``$``, thousands separators, a trailing ``%`` or ``.``, and trailing zeros after
    the decimal point: ``" $1,234.50 "`` -> ``"1234.5"``, ``"72.0"`` -> ``"72"``, ``"-0"`` -> ``"0"``,
    ``"50%"`` -> ``"50"``. Accepts the Unicode minus.
    """
    s = text.strip().replace("\u2212", "-").replace("$", "").replace(",", "").rstrip(".").removesuffix("%")
    try:
        value = Decimal(s.strip())
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    out = format(value.normalize(), "f")
    return "0" if out == "-0" else out


def extract_answer(response: str, *, strict: bool = False, last_number: bool = False) -> tuple[str | None, bool]:
    """The normalised final answer of a response and whether it was stated as ``#### N``.

    Args:
        response: the model's response text.
        strict: accept only a ``#### N`` answer.
        last_number: without ``#### N`` or ``\\boxed{}``, take the response's last number ("flexible extract").

    Returns:
        ``(answer or None, formatted)`` (module docstring for the rules).
    """
    for hashes in re.finditer("####", response):
        line = _clean(response[hashes.end():].split("\n", 1)[0])
        match = _ANSWER_NUMBER_RE.match(line, len(line) - len(line.lstrip()))
        if match:
            return _value(match), True
    if strict:
        return None, False
    boxed = _last_boxed(response)
    if boxed is not None:
        return _boxed_answer(_clean(boxed)), False
    if not last_number:
        return None, False
    numbers = list(_NUMBER_RE.finditer(_clean(response)))
    return (_value(numbers[-1]) if numbers else None), False


def ground_truth_number(answer: str) -> str:
    """The normalised final number of a GSM8K answer: after its last ``####``, or the whole text.

    Raises:
        RewardError: no number there.
    """
    tail = answer.rsplit("####", 1)[-1]
    number = normalize_number(tail)
    if number is None:
        raise RewardError(f"GSM8K ground truth {answer[-80:]!r} has no number after '####' (or is not a "
                          "number); expected the dataset's answer text or the bare number")
    return number


@register_reward("gsm8k")
def gsm8k_reward(prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str | None], *,
                 correct_score: float = 1.0, format_score: float = 0.1, strict: bool = False,
                 last_number: bool = False) -> list[float]:
    """Score GSM8K responses against their ground-truth numbers (module docstring).

    Args:
        prompts: unused.
        responses: ``B`` response texts.
        ground_truths: ``B`` GSM8K answers (the number, or the full solution ending in ``#### N``).
        correct_score: score of a correct answer.
        format_score: score of a wrong answer stated as ``#### N``; 0 disables it.
        strict: only a ``#### N`` answer can be correct.
        last_number: also accept the response's last number when it has neither ``#### N`` nor ``\\boxed{}``
            (lm-evaluation-harness's "flexible extract"; off: a cut-off response would count).

    Returns:
        ``B`` floats: ``correct_score``, ``format_score`` or 0.

    Raises:
        RewardError: a missing ground truth or one without a number.
    """
    scores = []
    for i, (response, truth) in enumerate(zip(responses, ground_truths)):
        if truth is None:
            raise RewardError(f"sample {i} has no ground truth; the gsm8k reward needs the dataset's answer "
                              "(set the data's ground-truth field)")
        expected = ground_truth_number(truth)  # an unreadable ground truth fails whatever the response
        answer, formatted = extract_answer(response, strict=strict, last_number=last_number)
        if answer is not None and answer == expected:
            scores.append(correct_score)
        else:
            scores.append(format_score if formatted else 0.0)
    return scores


def _clean(text: str) -> str:
    """``text`` with the LaTeX and Unicode spellings of signs, spaces, dollars and text boxes made plain."""
    text = text.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\%", "%")
    text = _TEXT_RE.sub(r" \1 ", text)
    return _SPACE_RE.sub(" ", text).replace("\\$", "").replace("$", "")


def _value(match: re.Match) -> str | None:
    """The normalised number of a :func:`_number_pattern` match."""
    digits = (match["int"] or "0").replace(",", "").replace(" ", "")
    return normalize_number(("-" if match["sign"] == "-" else "") + digits + match["dec"])


def _boxed_answer(content: str) -> str | None:
    """The number a (cleaned) ``\\boxed{}`` holds: after its last ``=``, one number or a fraction, or None."""
    tail = _EQUALS_RE.split(content)[-1]
    match = _BOXED_NUMBER_RE.fullmatch(tail)
    if match:
        return _value(match)
    match = _FRACTION_RE.fullmatch(tail)
    num, den = (_ANSWER_NUMBER_RE.fullmatch(match[k].strip()) if match else None for k in ("num", "den"))
    if num is None or den is None or Decimal(_value(den)) == 0:
        return None
    value = Fraction(Decimal(_value(num))) / Fraction(Decimal(_value(den))) * (-1 if match["sign"] == "-" else 1)
    rest = value.denominator
    for prime in (2, 5):
        while rest % prime == 0:
            rest //= prime
    if rest != 1:  # not a terminating decimal, so equal to no GSM8K answer
        return f"{value.numerator}/{value.denominator}"
    return normalize_number(str(Decimal(value.numerator) / Decimal(value.denominator)))


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` (braces matched), or None."""
    starts = list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))
    if not starts:
        return None
    depth, begin = 0, starts[-1].end()
    for k in range(begin, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            if depth == 0:
                return text[begin:k]
            depth -= 1
    return None
