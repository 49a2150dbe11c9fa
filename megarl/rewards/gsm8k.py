"""Rule reward for GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems").

The response's answer is, in order of preference:

1. the first number after ``####`` (the format the instruction asks for, :data:`GSM8K_INSTRUCTION`; the
   first so that a model cannot list several answers; a ``$`` between is allowed);
2. else the first number inside the last ``\\boxed{...}``;
3. else, only with ``last_number=True`` (lm-evaluation-harness's "flexible extract"), the last number in the
   response. It is off by default: a response cut at the length limit mid-sentence often ends with a number
   of the problem itself, which would count as correct when it equals the answer.

``strict`` accepts only 1.

Numbers are normalised before comparison (:func:`normalize_number`): thousands separators, ``$``, a trailing
``%`` or ``.``, units after the number and trailing zeros after the decimal point are dropped, so
``"$1,000.00"``, ``"1000 dollars"`` and ``"1000"`` are equal. The ground truth is the number after the last
``####`` of the dataset's answer (or the bare number that :func:`megarl.data.gsm8k.prepare_gsm8k` stores).

Scores (defaults): 1.0 for a correct answer; 0.1 (``format_score``) for a wrong answer stated as
``#### N``, a learning signal for small models that are rarely right (SmolLM2-135M); 0.0 otherwise.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Sequence

from megarl.rewards.registry import RewardError, register_reward

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."

# An optional minus (not one between two numbers: "5-3"), digits with optional thousands separators, and an
# optional decimal part.
_NUMBER = r"(?:(?<![\d])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_ANSWER_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")


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
    text = response.replace("\u2212", "-")
    match = _HASH_ANSWER_RE.search(text)
    if match:
        return normalize_number(match.group(1)), True
    if strict:
        return None, False
    boxed = _last_boxed(text)
    numbers = _NUMBER_RE.findall(boxed) if boxed is not None else []
    if numbers:
        return normalize_number(numbers[0]), False
    if not last_number:
        return None, False
    numbers = _NUMBER_RE.findall(text)
    return (normalize_number(numbers[-1]) if numbers else None), False


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
        answer, formatted = extract_answer(response, strict=strict, last_number=last_number)
        if answer is not None and answer == ground_truth_number(truth):
            scores.append(correct_score)
        else:
            scores.append(format_score if formatted else 0.0)
    return scores


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for k in range(begin, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            if depth == 0:
                return text[begin:k]
            depth -= 1
    return None
