"""The rollout/trainer mismatch figures (``megarl.algos.mismatch``) against float64 references written here with
Python loops and numpy: NeMo-RL's ``token_mult_prob_error`` and ``gen_kl_error`` (k3 of KL(gen || train)), the
max and p99 |diff|, per response-length bucket and per turn of multi-turn rows (an episode split over rows
included), and the step's ``mismatch/...`` metrics of :func:`megarl.trainer.old_logprobs.old_logprob_metrics`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megarl.algos.mismatch import (first_mismatch, first_turns, length_buckets, mismatch_metrics, mismatch_stats,
                                   turn_index)

NAN, INF = float("nan"), float("inf")


def reference(train, gen, mask) -> dict[str, float]:
    """The figures over the valid tokens, one token at a time in float64."""
    diffs = [float(t) - float(g) for tr, gr, mr in zip(train.tolist(), gen.tolist(), mask.tolist())
             for t, g, m in zip(tr, gr, mr) if m]
    if not diffs:
        return {"token_mult_prob_error": 1.0, "gen_kl_error": 0.0, "abs_diff_mean": 0.0, "abs_diff_max": 0.0,
                "abs_diff_p99": 0.0, "exact_tokens_frac": 1.0, "tokens": 0.0}
    n = len(diffs)
    return {"token_mult_prob_error": sum(math.exp(abs(d)) for d in diffs) / n,
            "gen_kl_error": sum(math.expm1(d) - d for d in diffs) / n,  # r - 1 - log r, r = p_train / p_gen
            "abs_diff_mean": sum(abs(d) for d in diffs) / n, "abs_diff_max": max(abs(d) for d in diffs),
            "abs_diff_p99": float(np.percentile(np.abs(np.array(diffs, dtype=np.float64)), 99)),
            "exact_tokens_frac": sum(d == 0 for d in diffs) / n, "tokens": float(n)}


def assert_figures(got: dict[str, torch.Tensor], want: dict[str, float], prefix: str = "") -> None:
    for k, v in want.items():
        assert got[prefix + k].dtype == torch.float64
        assert got[prefix + k].item() == pytest.approx(v, rel=1e-12, abs=1e-15), prefix + k


def random_case(seed: int, rows: int = 6, width: int = 40, scale: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(rows, width, generator=g) * 5
    train = gen + torch.randn(rows, width, generator=g) * scale
    mask = torch.rand(rows, width, generator=g) < 0.7
    train[~mask] = NAN  # outside the mask: never read
    gen[~mask] = -INF
    return train.float(), gen.float(), mask


def test_nemo_rl_examples_fix_the_definitions_and_the_sign():
    """NeMo-RL's own numbers: gen (-1, -2) and train (-1.5, -1.5) give exp(0.5) and cosh(0.5) - 1; a token vLLM
    gives -5 and the trainer -15 has gen_kl_error exp(-10) + 10 - 1 ~ 9 (docs/guides/grpo.md), not the 22,015 of
    the other direction."""
    s = mismatch_stats(torch.tensor([[-1.5, -1.5]]), torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2))
    assert s["token_mult_prob_error"].item() == pytest.approx(math.exp(0.5), rel=1e-12)
    assert s["gen_kl_error"].item() == pytest.approx(math.cosh(0.5) - 1, rel=1e-12)
    s = mismatch_stats(torch.tensor([[-15.0]]), torch.tensor([[-5.0]]), torch.ones(1, 1, dtype=torch.bool))
    assert s["gen_kl_error"].item() == pytest.approx(math.exp(-10) + 9, rel=1e-12)
    assert s["token_mult_prob_error"].item() == pytest.approx(math.exp(10), rel=1e-12)
    assert s["abs_diff_max"].item() == s["abs_diff_p99"].item() == 10.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stats_match_the_float64_reference_with_padding_nan_and_inf(seed):
    train, gen, mask = random_case(seed)
    assert_figures(mismatch_stats(train, gen, mask.float()), reference(train, gen, mask))


def test_exact_tokens_are_counted_bit_for_bit_and_the_first_other_one_is_named():
    """``exact_tokens_frac``: tokens whose two float32 log-probs are the same number (the nearest float32 is not
    enough); :func:`first_mismatch`: the first valid differing token, row-major; padding never counts."""
    train, gen, mask = random_case(7, rows=4, width=10)
    train = torch.where(mask, gen, train)  # every valid token exact
    assert mismatch_stats(train, gen, mask)["exact_tokens_frac"].item() == 1.0
    assert first_mismatch(train, gen, mask) is None
    valid = mask.nonzero().tolist()
    (r1, c1), (r2, c2) = valid[5], valid[-1]
    train[r2, c2] = torch.nextafter(gen[r2, c2], torch.tensor(0.0))  # one ulp off
    train[r1, c1] = gen[r1, c1] + 0.5
    got = mismatch_stats(train, gen, mask)
    assert got["exact_tokens_frac"].item() == pytest.approx((len(valid) - 2) / len(valid), rel=1e-15)
    assert_figures(got, reference(train, gen, mask))
    assert first_mismatch(train, gen, mask) == (r1, c1)
    padding = (~mask).nonzero()[0].tolist()
    assert first_mismatch(train, gen, mask & ~torch.zeros_like(mask).index_put_(
        (torch.tensor([r1]), torch.tensor([c1])), torch.tensor(True))) == (r2, c2)
    assert torch.isnan(train[padding[0], padding[1]])  # a NaN outside the mask is not a mismatch


def test_small_differences_keep_their_k3_to_float64_precision():
    """|diff| ~ 1e-4 (a bf16 engine against its trainer): k3 ~ 5e-9, which exp(d) - 1 - d in float32 cannot hold."""
    train, gen, mask = random_case(3, scale=1e-4)
    got = mismatch_stats(train, gen, mask)
    want = reference(train, gen, mask)
    assert 1e-10 < want["gen_kl_error"] < 1e-7
    assert got["gen_kl_error"].item() == pytest.approx(want["gen_kl_error"], rel=1e-9)
    naive = ((train - gen).exp() - 1 - (train - gen))[mask].mean().item()  # float32: off by far more
    assert abs(naive - want["gen_kl_error"]) > 0.1 * want["gen_kl_error"]


def test_identical_log_probs_and_an_empty_mask_give_the_perfect_values():
    train, gen, mask = random_case(4)
    s = mismatch_stats(gen, gen, mask)
    assert s["token_mult_prob_error"].item() == 1.0 and s["gen_kl_error"].item() == 0.0
    assert s["abs_diff_max"].item() == 0.0 and s["abs_diff_p99"].item() == 0.0
    empty = mismatch_stats(train, gen, torch.zeros_like(mask))
    assert {k: v.item() for k, v in empty.items()} == reference(train, gen, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="one shape"):
        mismatch_stats(train, gen[:, :-1], mask)


def test_length_buckets_and_their_figures():
    lengths = torch.tensor([1, 255, 256, 1023, 1024, 4095, 4096, 9000])
    bucket, names = length_buckets(lengths)
    assert names == ["len_0-255", "len_256-1023", "len_1024-4095", "len_4096+"]
    assert bucket.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="strictly increasing"):
        length_buckets(lengths, (10, 10))

    train, gen, mask = random_case(5, rows=8, width=12)
    lengths = torch.tensor([3, 12, 7, 5, 11, 2, 9, 6])
    edges = (4, 8)
    got = mismatch_metrics(train, gen, mask, lengths=lengths, edges=edges)
    assert_figures(got, reference(train, gen, mask))
    for name, lo, hi in (("len_0-3", 0, 4), ("len_4-7", 4, 8), ("len_8+", 8, 10**9)):
        rows = [i for i, n in enumerate(lengths.tolist()) if lo <= n < hi]
        sub = torch.zeros_like(mask)
        sub[rows] = mask[rows]
        assert_figures(got, reference(train, gen, sub), prefix=f"{name}/")
    empty = mismatch_metrics(train, gen, mask, lengths=torch.full((8,), 3), edges=edges)  # one bucket only
    assert not any(k.startswith(("len_4-7/", "len_8+/")) for k in empty)


def reference_turns(mask_rows: list[list[int]], episodes: list[int]) -> list[list[int]]:
    """Each sampled token's 0-based turn in its episode (runs of 1s, counted over the episode's rows in order)."""
    count: dict[int, int] = {}
    out = []
    for row, e in zip(mask_rows, episodes):
        k = count.get(e, 0) if e >= 0 else 0
        turns, prev = [], 0
        for m in row:
            if m and not prev:
                k += 1
            turns.append(k - 1 if m else -1)
            prev = m
        if e >= 0:
            count[e] = k
        out.append(turns)
    return out


def test_turns_of_multi_turn_rows_with_an_episode_split_over_two_rows():
    mask_rows = [[1, 1, 0, 0, 1, 0, 1, 1, 1, 0],   # episode 0: turns 1-3
                 [1, 1, 1, 0, 0, 1, 1, 0, 0, 0],   # episode 1, first row: turns 1-2
                 [0, 0, 1, 1, 0, 1, 0, 0, 0, 0],   # episode 1 after a split: turns 3-4
                 [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]   # padding
    episodes = [0, 1, 1, -1]
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    first = first_turns(mask, torch.tensor(episodes))
    assert first.tolist() == [0, 0, 2, 0]
    turns = turn_index(mask, first)
    assert turns.tolist() == reference_turns(mask_rows, episodes)
    assert turn_index(mask).tolist() == reference_turns(mask_rows, [0, 1, 2, -1])

    g = torch.Generator().manual_seed(6)
    gen = -torch.rand(4, 10, generator=g) * 3
    train = gen + torch.randn(4, 10, generator=g) * 0.1
    valid = mask.bool().clone()
    valid[2, 3] = False  # a token out of the figures (a non-finite rollout log-prob) does not split its turn
    got = mismatch_metrics(train, gen, valid, turns=turns)
    assert sorted({k.split("/")[0] for k in got if k.startswith("turn_")}) == ["turn_1", "turn_2", "turn_3",
                                                                               "turn_4"]
    ref = reference_turns(mask_rows, episodes)
    for k in range(4):
        sub = torch.tensor([[t == k for t in row] for row in ref]) & valid
        assert_figures(got, reference(train, gen, sub), prefix=f"turn_{k + 1}/")


def test_the_step_logs_the_figures_of_the_old_log_probs():
    """``old_logprob_metrics`` of a multi-turn batch: ``mismatch/...`` overall, per bucket and per turn over the
    response tokens with a finite rollout log-prob; ``actor/rollout_vs_old_logprob_diff`` is their mean |diff|."""
    from megarl.config import AlgorithmConfig
    from megarl.data.batch import build_batch
    from megarl.trainer.old_logprobs import old_logprob_metrics

    masks = [[1, 1, 0, 1, 1], [1, 0, 1], [1, 1, 1, 1]]
    g = torch.Generator().manual_seed(7)
    rollout = [torch.where(torch.tensor(m).bool(), -torch.rand(len(m), generator=g), 0.0) for m in masks]
    batch = build_batch([[5, 6]] * 3, [[7] * len(m) for m in masks], rollout, [0, 0, 1], pad_token_id=0,
                        response_masks=masks, meta={"episode": [0, 0, 1]})
    batch["rollout_logprobs"][2, 1] = NAN
    batch["logprob_nonfinite"] = ~torch.isfinite(batch["rollout_logprobs"]) & batch["response_mask"].bool()
    batch["old_logprobs"] = batch["rollout_logprobs"].nan_to_num(0.0) + torch.randn(3, 5, generator=g) * 0.02
    batch["loss_mask"] = batch["response_mask"] * ~batch["logprob_nonfinite"]
    got = old_logprob_metrics(batch, AlgorithmConfig(name="grpo"))
    valid = batch["response_mask"].bool() & ~batch["logprob_nonfinite"]
    old, roll = batch["old_logprobs"], batch["rollout_logprobs"]
    want = reference(old, roll, valid)
    assert got["actor/rollout_vs_old_logprob_diff"] == pytest.approx(want.pop("abs_diff_mean"), rel=1e-12)
    for k, v in want.items():
        assert got[f"mismatch/{k}"] == pytest.approx(v, rel=1e-12)
    # turns: episode 0 = row 0 (turns 1, 2) + row 1 (turns 3, 4); episode 1 = row 2 (turn 1)
    ref = reference_turns([m + [0] * (5 - len(m)) for m in masks], [0, 0, 1])
    for k in range(4):
        sub = torch.tensor([[t == k for t in row] for row in ref]) & valid
        assert got[f"mismatch/turn_{k + 1}/gen_kl_error"] == pytest.approx(reference(old, roll, sub)["gen_kl_error"],
                                                                          rel=1e-12)
    assert "mismatch/turn_5/tokens" not in got
    assert got["mismatch/len_0-255/tokens"] == want["tokens"]  # every response shorter than 256 tokens
