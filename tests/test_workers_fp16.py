"""fp16 actor updates through megatron's dynamic loss scaler: the schedule scales the loss by the optimizer's
loss scale and the optimizer divides it out again, so an fp16 update's gradient norm is the fp32 one's (without
``grad_scale_func`` it was 2**-32 of it: megatron's optimizer unscaled gradients that nothing had scaled); an
overflow of the scaled gradients skips the step, halves the scale (after megatron's hysteresis of 2) and
leaves the weights alone, counted in ``skipped_steps``."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

SPEC = ModelSpec("llama", 64, 32, 1, 4, 2, 16, 64, tie_word_embeddings=True)


def _updates(rank, world):
    """Per dtype: the metrics of one update of the same batch (advantages of scale 1), then, for fp16, two
    updates with advantages of 1e4 (scaled gradients beyond fp16's range) and whether the weights moved."""
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, OptimConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker
    from tests.rl_tasks import update_batch

    layout = ParallelLayout()
    initialize_model_parallel(layout)
    n = 4
    batch = update_batch(n, 60)
    algo = AlgorithmConfig(kl=KLConfig(coef=0.0))
    out = {}
    for dtype in (torch.float32, torch.float16):
        rc = ActorConfig(optim=OptimConfig(lr=1e-3, clip_grad=1e9), micro_batch_size=2, ppo_mini_batch_size=n)
        worker = PolicyWorker(SPEC, layout, "actor", "preset:random", dtype, rc, trainable=True, total_updates=3,
                              temperature=1.0)
        out[dtype] = worker.update(batch, algo, seed=0)
        if dtype == torch.float16:
            before = [p.detach().clone() for p in worker.chunks[0].parameters()]
            big = batch.select(torch.arange(n))
            big["advantages"] = batch["advantages"] * 1e4
            out["overflow"] = [worker.update(big, algo, seed=0)[0] for _ in range(2)]
            out["moved"] = any(not torch.equal(a, p.detach()) for a, p in zip(before, worker.chunks[0].parameters()))
    return {str(k): v for k, v in out.items()}


def test_fp16_updates_match_fp32_and_overflows_skip_the_step():
    r = run_world(_updates, 1)[0]
    fp32, fp16 = r["torch.float32"][0], r["torch.float16"][0]
    assert fp16["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=2e-2), (fp16, fp32)
    assert fp16["loss_scale"] == 2.0 ** 16 and fp16["skipped_steps"] == 0.0
    assert "loss_scale" not in fp32
    first, second = r["overflow"]
    assert first["skipped_steps"] == second["skipped_steps"] == 1.0
    assert first["loss_scale"] == 2.0 ** 16 and second["loss_scale"] == 2.0 ** 15  # megatron's hysteresis 2
    assert not r["moved"]
