"""The arithmetic task's reward (:mod:`megarl.data.arithmetic`): 1 when the response's final number is the sum.

The answer is read as GSM8K's flexible extract reads it (:func:`megarl.rewards.gsm8k.extract_answer` with
``last_number=True``: a ``#### N`` or ``\\boxed{N}`` answer first, else the last number), so "7 + 12 = 19",
"19." and "The answer is 19" all score 1, and "7 + 12 = 19, or 20" scores 0.
"""

from __future__ import annotations

from typing import Sequence

from megarl.rewards.gsm8k import extract_answer, normalize_number
from megarl.rewards.registry import RewardError, register_reward


@register_reward("arithmetic")
def arithmetic_reward(prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str | None], *,
                      correct_score: float = 1.0) -> list[float]:
    """Score ``B`` responses against their ground-truth numbers.

    Args:
        prompts: unused.
        responses: ``B`` response texts.
        ground_truths: ``B`` numbers, as text ("19").
        correct_score: score of a correct answer (a wrong or missing one scores 0).

    Returns:
        ``B`` floats.

    Raises:
        RewardError: a ground truth that is missing or not a number.
    """
    scores = []
    for i, (response, truth) in enumerate(zip(responses, ground_truths)):
        expected = normalize_number(truth) if truth is not None else None
        if expected is None:
            raise RewardError(f"sample {i}: ground truth {truth!r} is not a number; the arithmetic reward needs the "
                              "sum as the data's ground-truth field (data.answer_key)")
        answer, _ = extract_answer(response, last_number=True)
        scores.append(correct_score if answer == expected else 0.0)
    return scores
