"""Packed (THD) micro-batches (``actor.sequence_packing``): the packing's invariants, ``SDPAttention`` on packed
sequences against SDPA on each sequence alone, and on one 2-rank gloo world at PP=1 (DP=2), PP=2 and TP=2 with
sequence parallelism the packed actor and critic against the padded ones (fixed-size micro-batches, the
independent path) on the same weights and batch: log-probs, entropy, values, every parameter's gradient after one
backward of the same loss, and one update's losses and gradient norm; finally a trainer run at PP=2 whose first
step equals the unpacked run's."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.workers.packing import pack_rows, pack_sequences, pack_shares
from tests.distributed import run_world
from tests.test_dynamic_batch import SPEC, _batch

BUDGET = 64  # tokens per packed micro-batch; the batch's rows hold 3 to 51 tokens
LAYOUTS = [(1, 1), (1, 2), (2, 1)]  # (tp, pp) in a world of 2; TP=2 with sequence parallelism


def test_packing_fills_micro_batches_within_the_budget_and_every_dp_rank_gets_as_many():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        n = int(torch.randint(2, 40, (1,), generator=g))
        lengths = torch.randint(1, 100, (n,), generator=g)
        budget = int(torch.randint(50, 300, (1,), generator=g))
        groups = pack_sequences(lengths, budget)
        assert sorted(torch.cat(groups).tolist()) == list(range(n))
        for idx in groups:
            assert len(idx) == 1 or int(lengths[idx].sum()) <= budget
        # first-fit: no two micro-batches could have been one (each holds more than the budget's half, but one)
        assert sum(int(lengths[idx].sum()) <= budget // 2 for idx in groups) <= 1
        shares = pack_shares(lengths[:n - n % 2], 2, budget, packed=True)
        assert len(shares[0]) == len(shares[1])
    with pytest.raises(ValueError, match="budget"):
        pack_sequences(torch.tensor([3]), 0)


def test_pack_rows_lays_sequences_back_to_back_with_restarting_positions():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    mb = pack_rows({"input_ids": ids, "prompt_lens": torch.tensor([1, 1, 2])}, torch.tensor([3, 2, 4]), 12)
    assert mb["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    assert mb["cu_seqlens"].tolist() == [0, 3, 5, 9, 12] and mb["cu_seqlens"].dtype == torch.int32
    assert mb["seq_offsets"].tolist() == [0, 3, 5] and mb["prompt_lens"].tolist() == [1, 1, 2]
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        pack_rows({"input_ids": ids}, torch.tensor([3, 2, 4]), 8)


def test_packing_config_names_both_fields():
    from megarl.config import ActorConfig, ConfigError, load_config
    from megarl.parallel.placement import validate_for_world

    with pytest.raises(ConfigError, match="sequence_packing.*max_tokens_per_micro_batch > 0"):
        ActorConfig(sequence_packing=True)
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch.*sequence_packing=true"):
        validate_for_world(load_config(None, ["actor.parallel.pp=2", "actor.max_tokens_per_micro_batch=64"]), 2)
    validate_for_world(load_config(None, ["actor.parallel.pp=2", "actor.max_tokens_per_micro_batch=64",
                                          "actor.sequence_packing=true"]), 2)


def _attention_checks(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """SDPAttention on a packed row (megatron's THD layout, and the ``sbhd`` one the trainer uses) vs on each of
    its sequences alone (causal), with GQA, with and without a sliding window: the largest difference of the
    output and of the gradients of query, key and value, per ``(layout, window)``. On CUDA in bf16 the packed
    row runs FlashAttention's variable-length kernel, the sequences alone SDPA's causal kernels."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.kernels.attention import SDPAttention

    cu = torch.tensor([0, 5, 12, 13, 20], dtype=torch.int32)  # the last segment: 7 tokens of tail padding
    out = {}
    for fmt, window in [(f, w) for f in ("thd", "sbhd") for w in (None, (3, 0))]:
        params = PackedSeqParams(qkv_format=fmt, cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
                                 max_seqlen_q=20, max_seqlen_kv=20)
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   kv_channels=16, use_cpu_initialization=True, attention_dropout=0.0,
                                   window_size=window)
        module = SDPAttention(config, 1, AttnMaskType.causal, "self")
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(20, n, 16, generator=g).to(device, dtype) for n in (4, 2, 2))
        grad_out = torch.randn(20, 64, generator=g).to(device, dtype)
        res = []
        for packed in (True, False):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            if packed and fmt == "thd":
                y = module(*inputs, None, packed_seq_params=params)
            elif packed:  # [t, 1, n, d]
                y = module(*(t.unsqueeze(1) for t in inputs), None, packed_seq_params=params).squeeze(1)
            else:  # [t, n, d] -> [s, 1, n, d] per sequence
                y = torch.cat([module(*(t[a:b].unsqueeze(1) for t in inputs), None).squeeze(1)
                               for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
            y.backward(grad_out)
            res.append([y.detach()] + [t.grad for t in inputs])
        out[fmt, window] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*res))
    return out


def _frame(worker, mb, out):
    from megarl.workers.actor import PolicyWorker

    return worker._logprobs(mb, out, False)[0] if isinstance(worker, PolicyWorker) else worker._values(mb, out)


def _gradients(worker, batch) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (after DP reduction) of one backward of ``sum(adv * x * mask) / tokens`` (``x``:
    log-probs or values), the whole batch in one mini-batch."""
    from megarl.models.pipeline import run_microbatches
    from megarl.workers.actor import PolicyWorker
    from megarl.workers.engine import MODEL_INPUTS

    micro, _ = worker._micro_batches(batch, MODEL_INPUTS + ("advantages",), 2)
    scale, tokens = len(micro) * worker.dp_size, float(batch["response_mask"].sum())

    def output_fn(mb, out):
        loss = (_frame(worker, mb, out) * mb["advantages"] * mb["response_mask"]).sum() / tokens
        return loss * scale, {}

    worker.model.train()
    worker.model.zero_grad_buffer()
    kwargs = worker._model_kwargs(False) if isinstance(worker, PolicyWorker) else None
    run_microbatches(worker.model, micro, output_fn, forward_only=False, model_kwargs=kwargs)
    return {n: p.main_grad.clone() for n, p in worker.bare.named_parameters()}


def _layout_checks(tp: int, pp: int) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, OptimConfig, ParallelConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker
    from megarl.workers.critic import CriticWorker

    mesh = ParallelLayout(tp=tp, pp=pp, dp=2 // (tp * pp))
    initialize_model_parallel(mesh, seed=0)
    torch.manual_seed(0)  # the same random weights on every DP rank (CPU init reads torch's global RNG)
    # optim.distributed=False: gradients all-reduced over DP (the distributed optimizer leaves each rank's
    # gradient buffer reduced only on the parameters it owns)
    common = dict(parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=tp > 1), micro_batch_size=2,
                  ppo_mini_batch_size=8, optim=OptimConfig(lr=1e-3, distributed=False))
    rcs = [ActorConfig(**common), ActorConfig(**common, max_tokens_per_micro_batch=BUDGET, sequence_packing=True)]
    actors = [PolicyWorker(SPEC, mesh, "actor", "preset:random", torch.float32, rcs[0], trainable=True,
                           temperature=1.0)]
    actors.append(PolicyWorker(SPEC, mesh, "actor", actors[0], torch.float32, rcs[1], trainable=True,
                               temperature=1.0))
    critics = [CriticWorker(SPEC, mesh, "critic", "preset:random", torch.float32, rc, trainable=True)
               for rc in rcs]
    critics[1].bare.load_state_dict(critics[0].bare.state_dict())
    batch = _batch()
    mask = batch["response_mask"].bool()  # padding columns hold whatever a position gave: not compared
    out = {"micro_batches": [tuple(m["input_ids"].shape)
                             for m in actors[1]._micro_batches(batch, ("input_ids",), 2)[0]]}
    lp = [w.compute_logprobs(batch, with_entropy=True) for w in actors]
    out["logprobs"] = max(float(torch.where(mask, lp[0][k] - lp[1][k], 0.0).abs().max())
                          for k in ("logprobs", "entropy"))
    values = [w.compute_values(batch) for w in critics]
    out["values"] = float(torch.where(mask, values[0] - values[1], 0.0).abs().max())
    grads = [[_gradients(w, batch) for w in pair] for pair in (actors, critics)]
    out["grads"] = max(float((a[n] - b[n]).abs().max()) for a, b in grads for n in a)
    out["grad_scale"] = max(float(g.abs().max()) for a, _ in grads for g in a.values())
    batch["old_logprobs"] = lp[0]["logprobs"] + 0.05 * batch["advantages"]  # some ratios clip
    batch["values"], batch["returns"] = values[0], values[0] + batch["advantages"]
    alg = AlgorithmConfig(kl=KLConfig(coef=0.0), entropy_coef=0.01)
    out["updates"] = [w.update(batch, alg, seed=5) for w in actors]
    out["critic_updates"] = [w.update(batch, alg, seed=5) for w in critics]
    ps.destroy_model_parallel()
    return out


def _world(rank, world):
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(dp=2))
    return {"attention": _attention_checks(), **{layout: _layout_checks(*layout) for layout in LAYOUTS}}


@pytest.fixture(scope="module")
def world():
    return run_world(_world, 2)


@pytest.mark.parametrize("fmt", ["thd", "sbhd"])
@pytest.mark.parametrize("window", [None, (3, 0)])
def test_sdpa_attention_on_packed_sequences_equals_each_sequence_alone(world, fmt, window):
    for r in world:
        assert r["attention"][fmt, window] <= 1e-5, r["attention"]


def _gpu_attention_checks(rank, world):
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout())
    return _attention_checks("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_varlen_attention_on_packed_sequences_equals_each_sequence_alone():
    diffs = run_world(_gpu_attention_checks, 1)[0]
    print(f"\npacked attention, FlashAttention varlen vs each sequence alone (bf16): {diffs}")
    assert max(diffs.values()) <= 2e-2, diffs


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_packed_micro_batches_equal_the_padded_ones(world, tp, pp):
    for r in world:
        res = r[(tp, pp)]
        shapes = res["micro_batches"]
        assert all(s[0] == 1 and s[1] <= BUDGET for s in shapes) and len(shapes) < 16 // (2 // (tp * pp))
        if pp > 1:  # one shape for the pipeline schedule
            assert len(set(shapes)) == 1
        if tp > 1:
            assert all(s[1] % tp == 0 for s in shapes)
        assert res["logprobs"] <= 1e-5 and res["values"] <= 1e-5, res
        assert res["grad_scale"] > 1e-3 and res["grads"] <= 1e-5, res
        for updates, keys in ((res["updates"], ("pg_loss", "entropy", "grad_norm")),
                              (res["critic_updates"], ("vf_loss", "grad_norm"))):
            assert len(updates[0]) == len(updates[1]) == 2  # 16 rows / mini-batches of 8
            for a, b in zip(*updates):
                for key in keys:
                    assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a, b)


@pytest.mark.slow  # two 2-rank trainer runs (~2 minutes); the packed passes' parity is the world's test above
def test_trainer_with_packing_at_pp2_matches_the_unpacked_run_at_step_1(tmp_path):
    from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts
    from tests.test_trainer import COMPARED, LAYOUT

    model, data = make_tiny_model(tmp_path / "model"), write_prompts(tmp_path / "prompts.jsonl", 16)
    base = task_overrides(model, data, tmp_path / "runs", "padded") + LAYOUT + ["actor.parallel.pp=2"]
    padded = run_world(train_on_rank, 2, base)[0][0]
    packed = run_world(train_on_rank, 2, base + ["run.name=packed", "actor.max_tokens_per_micro_batch=48",
                                                 "actor.sequence_packing=true"])[0][0]
    assert padded["actor/ppo_kl"] != 0  # the second mini-batch ran after an update: the losses are not trivial
    for key in COMPARED:
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_packing_benchmark_runs_on_the_cpu(tmp_path):
    from megarl.bench.packing import main

    out = main(["--model", "tiny", "--rows", "2", "--budget", "512", "--steps", "1", "--warmup", "0",
                "--long-tokens", "64", "--long-rows", "1", "--device", "cpu", "--out", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text()) == out
    assert out["packed"]["padded_tokens"] == out["real_tokens"] < out["padded"]["padded_tokens"]
    assert out["packed_speedup"] > 0 and out["long"]["flops"] > 0 and out["long"]["micro_batches"] == 1
