"""Rollout/trainer mismatch: how far the rollout engine's log-probs of the sampled tokens are from the trainer's.

The rollout engine (vLLM) and the trainer compute the log-prob of the same token with other kernels, so they
differ slightly even at the same weights (:mod:`megarl.algos.rollout_correction` corrects for it). These are
the figures that measure it, as NeMo-RL defines them (NVIDIA-NeMo/RL at 7ea279a:
``nemo_rl/algorithms/loss/loss_functions.py``, ``ClippedPGLossFn.__call__``, and ``calculate_kl`` in
``nemo_rl/algorithms/utils.py``; ``docs/guides/grpo.md``, section "Metrics"). With ``d_t = logp_train_t -
logp_gen_t`` for each valid token ``t`` (``N`` of them):

- ``token_mult_prob_error = (1/N) sum_t exp(|d_t|)``: the mean multiplicative error of the sampled tokens'
  probabilities; 1.0 is perfect (NeMo-RL's nightly runs require a median < 1.1).
- ``gen_kl_error = (1/N) sum_t (exp(d_t) - 1 - d_t)``: the k3 estimator (Schulman 2020,
  http://joschu.net/blog/kl-approx.html) of ``KL(pi_gen || pi_train)`` from tokens sampled by ``pi_gen``
  (with ``r = pi_train / pi_gen``, k3 is ``r - 1 - log r``: unbiased, never negative). NeMo-RL's
  ``calculate_kl(logprobs=generation_logprobs, logprobs_reference=prev_logprobs, kl_type="k3")`` with
  ``logr = prev_logprobs - generation_logprobs`` and no clamping; it is also
  :func:`~megarl.algos.rollout_correction.rollout_correction`'s ``kl_k3`` (which clamps ``|d_t| <= 20`` and
  runs over the loss mask). 0 is perfect.
- ``abs_diff_mean``, ``abs_diff_max`` and ``abs_diff_p99``: the mean, largest and 99th percentile of ``|d_t|``
  (the percentile interpolated linearly between order statistics, numpy's default).
- ``exact_tokens_frac``: the fraction of the ``N`` tokens whose two log-probs are the same number (``d_t == 0``,
  bit for bit in the float32 both engines report): 1.0 is what ``rollout.exact`` promises, and
  :func:`first_mismatch` names the first token that breaks it.
- ``tokens``: ``N``.

Everything is computed in float64 (``expm1``): at the |d| of 1e-3 typical of bf16, k3 is ~5e-7, which float32's
``exp(d) - 1`` would get wrong by ~20%. Positions outside the mask never reach a figure, NaN or infinite as they
may be; with no valid token the figures are the perfect values (1, 0, 0, 0, 0, 1) and ``tokens`` is 0.

:func:`mismatch_metrics` adds the same figures per response-length bucket (:func:`length_buckets`) and, for
multi-turn episodes, per turn (:func:`turn_index`).
"""

from __future__ import annotations

from typing import Sequence

import torch

LENGTH_EDGES = (256, 1024, 4096)  # response-length buckets: [1, 256), [256, 1024), [1024, 4096), [4096, inf)
STATS = ("token_mult_prob_error", "gen_kl_error", "abs_diff_mean", "abs_diff_max", "abs_diff_p99", "exact_tokens_frac",
         "tokens")


def mismatch_stats(train_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor
                   ) -> dict[str, torch.Tensor]:
    """The figures of the module docstring over the valid tokens of ``mask``.

    Args:
        train_logprob: ``[B, T]`` float, the trainer's log-prob of each sampled token (the old log-probs).
        rollout_logprob: ``[B, T]`` float, the rollout engine's log-prob of the same tokens.
        mask: ``[B, T]`` bool/int/float, nonzero on the tokens that count.

    Returns:
        ``{name: 0-dim float64 tensor}`` for each name of :data:`STATS`.

    Raises:
        ValueError: the three shapes differ.
    """
    if not train_logprob.shape == rollout_logprob.shape == mask.shape:
        raise ValueError(f"train_logprob, rollout_logprob and mask must have one shape, got "
                         f"{[tuple(t.shape) for t in (train_logprob, rollout_logprob, mask)]}")
    m = mask.bool()
    d = train_logprob[m].double() - rollout_logprob[m].double()
    n = d.numel()
    if n == 0:
        zero = d.new_zeros(())
        return {"token_mult_prob_error": zero + 1, "gen_kl_error": zero, "abs_diff_mean": zero,
                "abs_diff_max": zero, "abs_diff_p99": zero, "exact_tokens_frac": zero + 1, "tokens": zero}
    a = d.abs()
    return {"token_mult_prob_error": a.exp().mean(), "gen_kl_error": (torch.expm1(d) - d).mean(),
            "abs_diff_mean": a.mean(), "abs_diff_max": a.max(), "abs_diff_p99": _quantile(a, 0.99),
            "exact_tokens_frac": (d == 0).double().mean(), "tokens": d.new_tensor(float(n))}


def first_mismatch(train_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor
                   ) -> tuple[int, int] | None:
    """The first valid token (row-major: the lowest row, then the lowest column) whose two log-probs differ,
    as ``(row, column)``; None where every valid token's are equal. Shapes and ``mask`` as in
    :func:`mismatch_stats` (a NaN on both sides differs)."""
    where = (mask.bool() & (train_logprob != rollout_logprob)).nonzero()
    return None if where.numel() == 0 else (int(where[0, 0]), int(where[0, 1]))


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q`` quantile of 1-D ``x`` interpolated linearly between its order statistics (numpy's default),
    from two selections, not a sort (torch.quantile refuses more than 2^24 elements)."""
    h = (x.numel() - 1) * q
    lo = int(h)
    below = torch.kthvalue(x, lo + 1).values
    above = torch.kthvalue(x, min(lo + 2, x.numel())).values
    return below + (h - lo) * (above - below)


def length_buckets(lengths: torch.Tensor, edges: Sequence[int] = LENGTH_EDGES) -> tuple[torch.Tensor, list[str]]:
    """Each row's response-length bucket.

    Args:
        lengths: ``[B]`` int, each row's response length in tokens.
        edges: increasing bucket boundaries ``e_1 < e_2 < ...``: bucket 0 is ``[0, e_1)``, bucket ``k`` is
            ``[e_k, e_{k+1})``, the last ``[e_last, inf)``.

    Returns:
        ``(bucket [B] int64, names)``: the names ``len_0-255``, ``len_256-1023``, ..., ``len_4096+`` (ends
        inclusive) for the default edges.

    Raises:
        ValueError: edges not strictly increasing positive integers.
    """
    edges = [int(e) for e in edges]
    if not edges or edges[0] <= 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"length bucket edges must be strictly increasing positive integers, got {edges}")
    bounds = [0, *edges]
    names = [f"len_{lo}-{hi - 1}" for lo, hi in zip(bounds, bounds[1:])] + [f"len_{edges[-1]}+"]
    return torch.bucketize(lengths.long(), torch.tensor(edges, dtype=torch.long, device=lengths.device),
                           right=True), names


def turn_index(response_mask: torch.Tensor, first_turn: torch.Tensor | None = None) -> torch.Tensor:
    """The turn of each sampled token of multi-turn rows.

    A row's turns are its runs of consecutive sampled tokens (``response_mask`` nonzero), the tokens between
    them being the context the episode added (observations, the template's turn end and next header:
    :mod:`megarl.agents.episode`); two turns with no context token between them count as one.

    Args:
        response_mask: ``[B, T]`` bool/int/float, nonzero on the sampled tokens.
        first_turn: ``[B]`` int64, the turn (0-based) of each row's first run: its episode's turns in the rows
            before it (an episode split over several rows, :func:`first_turns`); None: 0.

    Returns:
        ``[B, T]`` int64: the 0-based turn of each sampled token, -1 elsewhere.
    """
    m = response_mask.bool()
    starts = m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]
    turn = starts.long().cumsum(-1) - 1
    if first_turn is not None:
        turn = turn + first_turn.long()[:, None]
    return torch.where(m, turn, -1)


def first_turns(response_mask: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: for each row, the turns of the rows of the same episode before it (rows of an episode in
    their order in the episode; ``episode [B]`` int64 ids, negative for padding rows: 0)."""
    m = response_mask.bool()
    runs = (m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]).sum(-1).tolist()
    seen: dict[int, int] = {}
    out = []
    for e, r in zip(episode.tolist(), runs):
        out.append(seen.get(e, 0) if e >= 0 else 0)
        if e >= 0:
            seen[e] = seen.get(e, 0) + r
    return torch.tensor(out, dtype=torch.int64, device=response_mask.device)


def mismatch_metrics(train_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor, *,
                     lengths: torch.Tensor | None = None, edges: Sequence[int] = LENGTH_EDGES,
                     turns: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """:func:`mismatch_stats` over the whole batch, per response-length bucket and per turn.

    Args:
        train_logprob, rollout_logprob, mask: ``[B, T]`` as in :func:`mismatch_stats`.
        lengths: ``[B]`` int, each row's response length (tokens), for the buckets; None: no buckets.
        edges: the buckets' boundaries (:func:`length_buckets`).
        turns: ``[B, T]`` int64 from :func:`turn_index` (-1 outside the turns); None: no per-turn figures.

    Returns:
        ``{name: 0-dim float64 tensor}``: each stat of :data:`STATS` under its own name, as
        ``<bucket>/<stat>`` for each bucket with a valid token, and ``turn_<k>/<stat>`` (1-based ``k``) for
        each turn with a valid token.
    """
    out = mismatch_stats(train_logprob, rollout_logprob, mask)
    m = mask.bool()
    groups: list[tuple[str, torch.Tensor]] = []
    if lengths is not None:
        bucket, names = length_buckets(lengths, edges)
        groups += [(names[k], m & (bucket == k)[:, None]) for k in bucket.unique().tolist()]
    if turns is not None:
        groups += [(f"turn_{k + 1}", m & (turns == k)) for k in turns[m].unique().tolist()]
    for name, sub in groups:
        if sub.any():
            out.update({f"{name}/{k}": v for k, v in mismatch_stats(train_logprob, rollout_logprob, sub).items()})
    return out
