"""The actor's Adam runs torch's fused kernel (megatron builds torch's AdamW without it; torch's per-tensor loop is
6x slower on the CPU main job, its GPU ``foreach`` kernels hold two fp32 copies of the parameters;
:func:`megarl.workers.optimizer.use_fused_adam`), with the per-tensor loop's results: on the CPU here, on the GPU
where the worker finds one."""

from __future__ import annotations

import torch

from tests.distributed import run_world
from tests.rl_tasks import update_batch
from tests.test_workers_lr import SPEC


def _weights_after_updates(rank, world):
    """The ``fused`` setting of the actor optimizer's groups as built, and the actor's parameters before and
    after 3 updates, run with torch's fused Adam (as built) and with its per-tensor loop (``fused`` unset)."""
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, OptimConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker

    layout = ParallelLayout()
    initialize_model_parallel(layout)
    rc = ActorConfig(optim=OptimConfig(lr=1e-2, weight_decay=0.1), micro_batch_size=2, ppo_mini_batch_size=2)
    built, before, after = [], None, {}
    for fused in (True, False):
        worker = PolicyWorker(SPEC, layout, "actor", "preset:random", torch.float32, rc, trainable=True,
                              total_updates=3, temperature=1.0)
        groups = [g for o in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
                  for g in o.optimizer.param_groups]
        built = built or [g["fused"] for g in groups]
        for g in groups:
            g["fused"] = fused
        before = before or {n: p.detach().clone() for n, p in worker.model.named_parameters()}
        worker.update(update_batch(6, 60), AlgorithmConfig(kl=KLConfig(coef=0.0)), seed=0)
        after[fused] = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    return built, before, after


def test_cpu_adam_runs_fused_with_the_per_tensor_loops_results():
    (built, before, after), = run_world(_weights_after_updates, 1)
    assert built and all(f is True for f in built), built
    fast, loop = after[True], after[False]
    for name in fast:  # the updates move each weight by ~3e-2; the two kernels' rounding differs by < 1e-6
        torch.testing.assert_close(fast[name], loop[name], rtol=0, atol=1e-6, msg=name)
    assert all(not torch.equal(before[n], fast[n]) for n in fast)  # every parameter trained
