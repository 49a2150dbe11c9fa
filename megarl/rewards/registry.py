"""Reward functions by name (built-in) or by dotted path (user code), behind one calling convention.

A reward function scores a batch of responses::

    fn(prompts: list[str], responses: list[str], ground_truths: list[str | None], **params) -> Sequence[float]

- ``prompts``: the raw prompt of each sample (the dataset's prompt text, before the chat template);
- ``responses``: the decoded response text (special tokens stripped);
- ``ground_truths``: the dataset's ground-truth field of each sample, or None where there is none;
- ``**params``: the function's own keyword parameters, fixed for the run (from the config);
- returns one float per sample (a list, a numpy array or a tensor). None, NaN or an infinity means "no score":
  the trainer drops that sample from its group and counts it (``reward/nonfinite``; the rule, and the share
  of samples past which the step fails, are in :mod:`megarl.algos.nonfinite`).

A batch at a time (not one sample) so that model-based rewards can batch their forward passes. A class whose
instances are such callables may be registered too (e.g. :class:`~megarl.rewards.reward_model.RewardModel`);
it is instantiated once with ``**params``.

Built-in names: "gsm8k" (:mod:`megarl.rewards.gsm8k`), "arithmetic" (:mod:`megarl.rewards.arithmetic`),
"reward_model" (:mod:`megarl.rewards.reward_model`), "http" (a reward model served over HTTP,
:mod:`megarl.rewards.http_reward`).
User functions: register with ``@register_reward("name")`` in a module imported before the trainer starts,
or name them by path, ``"mypkg.mymod:fn"`` or ``"mypkg.mymod.fn"`` (importable from ``sys.path``).
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from typing import Any, Callable, Mapping, Sequence

import torch

from megarl.algos.registry import Registry

RewardFn = Callable[..., Sequence[float]]

REWARDS: Registry[RewardFn] = Registry("reward function", "register_reward")
register_reward = REWARDS.register


class RewardError(ValueError):
    """A reward function that cannot be found, built or called, or that returned unusable scores."""


class LoadedReward:
    """A reward function bound to its parameters; call it to score a batch.

    Attributes:
        name: the name or path it was loaded from.
    """

    def __init__(self, name: str, fn: Callable[[list[str], list[str], list[str | None]], Sequence[float]]):
        self.name = name
        self._fn = fn

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 ground_truths: Sequence[str | None] | None = None) -> torch.Tensor:
        """Score ``B`` responses.

        Args:
            prompts / responses: ``B`` strings each (module docstring).
            ground_truths: ``B`` strings or Nones; None means no ground truth for any sample.

        Returns:
            ``[B]`` float32 scores, NaN where the function gave None (no score; NaN and infinities are kept:
            :mod:`megarl.algos.nonfinite` says what the trainer does with them).

        Raises:
            RewardError: inputs of different lengths, or the function returned the wrong number of scores or
                a value that is no number.
        """
        b = len(responses)
        truths = [None] * b if ground_truths is None else list(ground_truths)
        if not len(prompts) == b == len(truths):
            raise RewardError(f"reward {self.name!r}: got {len(prompts)} prompts, {b} responses and "
                              f"{len(truths)} ground truths; they must match")
        out = self._fn(list(prompts), list(responses), truths)
        if isinstance(out, (list, tuple)):
            out = [math.nan if s is None else s for s in out]
        try:
            scores = torch.as_tensor(out, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as e:
            raise RewardError(f"reward {self.name!r} returned {str(out)[:200]}, which is not one float per "
                              f"response ({type(e).__name__}: {e})") from None
        if scores.shape != (b,):
            raise RewardError(f"reward {self.name!r} returned scores of shape {tuple(scores.shape)} for {b} "
                              "responses; it must return one float per response")
        return scores


def load_reward_fn(spec: str, params: Mapping[str, Any] | None = None) -> LoadedReward:
    """Find a reward function by registered name or dotted path and bind its parameters.

    Args:
        spec: a registered name ("gsm8k", "reward_model", ...) or ``"package.module:attr"`` /
            ``"package.module.attr"``, where ``attr`` is a function or a class (module docstring).
        params: keyword parameters: bound to a function (checked against its signature now), or passed to a
            class's constructor.

    Returns:
        A :class:`LoadedReward`.

    Raises:
        RewardError: unknown name, a module that fails to import, a missing attribute, parameters that the
            function does not accept, or a class whose construction fails.
    """
    params = dict(params or {})
    obj = find_reward(spec)
    check_reward_params(spec, obj, params)
    if inspect.isclass(obj):
        try:
            return LoadedReward(spec, obj(**params))
        except TypeError as e:
            raise RewardError(f"cannot build reward {spec!r} with parameters {sorted(params)}: {e}") from e
    return LoadedReward(spec, functools.partial(obj, **params))


def check_reward_params(spec: str, obj: Any, params: Mapping[str, Any] | None) -> None:
    """Check ``params`` against what ``obj`` (from :func:`find_reward`) takes, without calling it: a function's
    keyword parameters after ``(prompts, responses, ground_truths)``, or a class's constructor's; and, where
    the parameter is annotated ``float``, ``int``, ``bool`` or ``str``, the value's type (an int is a float).

    Raises:
        RewardError: a parameter it does not take, a required one missing, or a value of the wrong type.
    """
    params = dict(params or {})
    signature = inspect.signature(obj)
    try:
        signature.bind(**params) if inspect.isclass(obj) else signature.bind([], [], [], **params)
    except TypeError as e:
        raise RewardError(f"reward function {spec!r} does not accept parameters {sorted(params)}: {e}; its "
                          f"signature is {spec}{signature}") from None
    try:
        hints = typing.get_type_hints(obj.__init__ if inspect.isclass(obj) else obj)
    except Exception:  # noqa: BLE001 (annotations that do not resolve: no type to check against)
        hints = {}
    for name, value in params.items():
        kind = hints.get(name)
        accepted = {float: (int, float), int: (int,), bool: (bool,), str: (str,)}.get(kind)
        if accepted and (not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool))):
            raise RewardError(f"{name}={value!r} is a {type(value).__name__}, but reward {spec!r} takes a "
                              f"{kind.__name__} there; its signature is {spec}{signature}")


def find_reward(spec: str) -> Any:
    """The function or class that ``spec`` names (a registered name or a dotted path), not yet bound or built.

    Raises:
        RewardError: unknown name, a module that fails to import, a missing attribute, not callable.
    """
    return REWARDS.find(spec, RewardError)


def task_metrics(tasks: Sequence[Any], scores: torch.Tensor, correct: Sequence[bool],
                 scored: torch.Tensor) -> dict[str, float]:
    """Reward figures per task, for data whose rows name one (a ``task`` field: reasoning-gym's,
    :mod:`megarl.environments.reasoning_gym`): ``reward/<task>/mean`` and ``reward/<task>/accuracy`` (score >= 1)
    over each task's scored samples.

    Args:
        tasks: ``B`` task names, None where a row names none (left out).
        scores: ``[B]`` float32. correct: ``B`` bools. scored: ``[B]`` bool, False where the score was dropped.
    """
    out: dict[str, float] = {}
    for task in sorted({str(t) for t in tasks if t is not None}):
        rows = [k for k, t in enumerate(tasks) if t is not None and str(t) == task and bool(scored[k])]
        if rows:
            out[f"reward/{task}/mean"] = scores[rows].mean().item()
            out[f"reward/{task}/accuracy"] = sum(bool(correct[k]) for k in rows) / len(rows)
    return out
