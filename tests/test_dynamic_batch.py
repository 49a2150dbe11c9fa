"""Micro-batches by token count (``actor.max_tokens_per_micro_batch``): the packing's invariants, and on 2-rank
gloo worlds (DP=2; TP=2 with sequence parallelism) the same log-probs, loss and gradient norm as the fixed-size
micro-batches on the same batch."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from megarl.workers.packing import balanced_shares, pack_by_tokens, pack_shares, padded_length
from tests.distributed import run_world

SPEC = ModelSpec("llama", 64, 32, 2, 4, 2, 8, 64, tie_word_embeddings=True, max_position_embeddings=128,
                 eos_token_ids=(1,))


def _cost(lengths, idx, multiple):
    return len(idx) * padded_length(int(lengths[idx].max()), multiple)


def test_packing_covers_every_row_once_within_the_budget():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        lengths = torch.randint(1, 100, (n,), generator=g)
        budget, multiple = int(torch.randint(50, 400, (1,), generator=g)), (1, 8)[trial % 2]
        groups = pack_by_tokens(lengths, budget, multiple=multiple)
        assert sorted(torch.cat(groups).tolist()) == list(range(n))
        for idx in groups:
            assert len(idx) == 1 or _cost(lengths, idx, multiple) <= budget
            assert lengths[idx].tolist() == sorted(lengths[idx].tolist(), reverse=True)
        more = pack_by_tokens(lengths, budget, multiple=multiple, min_count=n)
        assert len(more) == n and sorted(torch.cat(more).tolist()) == list(range(n))


def test_dp_shares_are_balanced_by_tokens_with_the_same_number_of_micro_batches():
    lengths = torch.tensor([90, 5, 90, 5, 90, 5, 90, 5])
    assert [s.tolist() for s in balanced_shares(lengths, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]  # 190 tokens each
    lengths = torch.tensor([90, 40, 40, 40, 40, 40])  # rank 0: 90 | 40 40, rank 1: 40 40 40 fits one, split
    shares = pack_shares(lengths, 2, 130)
    assert [[g.tolist() for g in s] for s in shares] == [[[0], [3, 4]], [[1], [2, 5]]]
    for share in shares:
        for idx in share:
            assert len(idx) == 1 or _cost(lengths, idx, 1) <= 130
    with pytest.raises(ValueError, match="budget"):
        pack_by_tokens(lengths, 0)


def _batch():
    from megarl.data.batch import build_batch

    g = torch.Generator().manual_seed(3)
    prompts, responses = [], []
    for i in range(16):
        prompts.append(torch.randint(2, 64, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist())
        responses.append(torch.randint(2, 64, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist())
    batch = build_batch(prompts, responses, [torch.zeros(len(r)) for r in responses], [i // 4 for i in range(16)],
                        pad_token_id=0, seq_multiple=8)
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=g) * batch["response_mask"]
    return batch


def _compare(rank, world, agg, budget, tp):
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, ParallelConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker

    mesh = ParallelLayout(tp=tp, dp=world // tp)
    initialize_model_parallel(mesh, seed=0)
    torch.manual_seed(0)  # the same random weights on every DP rank (CPU init reads torch's global RNG)
    parallel = ParallelConfig(tp=tp, sequence_parallel=tp > 1)
    fixed_rc = ActorConfig(parallel=parallel, micro_batch_size=2, ppo_mini_batch_size=8)
    dynamic_rc = ActorConfig(parallel=parallel, micro_batch_size=2, ppo_mini_batch_size=8,
                             max_tokens_per_micro_batch=budget)
    fixed = PolicyWorker(SPEC, mesh, "actor", "preset:random", torch.float32, fixed_rc, trainable=True,
                         temperature=1.0)
    dynamic = PolicyWorker(SPEC, mesh, "actor", fixed, torch.float32, dynamic_rc, trainable=True, temperature=1.0)
    batch = _batch()
    out = {"logprobs": [w.compute_logprobs(batch, with_entropy=True) for w in (fixed, dynamic)]}
    batch["old_logprobs"] = out["logprobs"][0]["logprobs"] + 0.05 * batch["advantages"]  # some ratios clip
    alg = AlgorithmConfig(kl=KLConfig(coef=0.0), entropy_coef=0.01, loss_agg_mode=agg)
    out["updates"] = [w.update(batch, alg, seed=5) for w in (fixed, dynamic)]
    out["padded_tokens"] = [sum(m["input_ids"].numel() for m in w._micro_batches(batch, ("input_ids",), 2)[0])
                            for w in (fixed, dynamic)]
    mask = batch["response_mask"].bool()  # padding columns hold whatever the last position gave: not compared
    out["logprobs"] = [{k: torch.where(mask, v, 0.0).numpy() for k, v in lp.items()}  # numpy: no shared memory
                       for lp in out["logprobs"]]
    return out


# DP=2, budget 1: one row per micro-batch, twice the fixed path's count (the loss scale must follow the count);
# TP=2 with sequence parallelism, budget 96: rows of similar length packed together, cut to multiples of 8 x TP
@pytest.mark.parametrize("agg,budget,tp", [("token-mean", 1, 1), ("seq-mean-token-mean", 96, 2)])
def test_dynamic_micro_batches_equal_the_fixed_size_path(agg, budget, tp):
    for r in run_world(_compare, 2, agg, budget, tp):
        (lf, ld), (uf, ud) = r["logprobs"], r["updates"]
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(torch.from_numpy(ld[key]), torch.from_numpy(lf[key]), rtol=0, atol=1e-5)
        assert len(uf) == len(ud) == 2  # 16 rows / mini-batches of 8
        # the same loss shares and gradient: global normalisers, the same scale (clipfrac and ppo_kl are means
        # over micro-batches, so they depend on how rows are grouped and are not compared)
        for a, b in zip(uf, ud):
            for key in ("pg_loss", "entropy", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)
        assert r["padded_tokens"][1] < r["padded_tokens"][0]  # the dynamic path padded less
