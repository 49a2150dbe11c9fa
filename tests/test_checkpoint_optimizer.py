"""Trainer checkpoints of a bf16 actor with megatron's DistributedOptimizer over DP=2: every parameter is
bf16 (the local spec's torch norm would keep fp32 weights and break megatron's bucket layout), and a
checkpoint restores parameters, fp32 main parameters and Adam moments exactly."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

# hidden 96: a norm weight that does not fill a 64-element bucket alignment, where an fp32 weight in a bf16
# buffer shows up as twice its size
SPEC = ModelSpec("qwen2", 1000, 96, 2, 4, 2, 24, 200, tie_word_embeddings=True)


def _roundtrip(rank, world, tmp):
    from megarl.config import ActorConfig
    from megarl.models import checkpoint as ck
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.engine import MegatronWorker

    initialize_model_parallel(ParallelLayout(dp=world))
    worker = MegatronWorker(SPEC, ParallelLayout(dp=world), "actor", "preset:random", torch.bfloat16,
                            ActorConfig(), trainable=True)
    dtypes = {p.dtype for p in worker.bare.parameters()}

    def step(seed):
        g = torch.Generator().manual_seed(seed + rank)
        for p in worker.model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
        worker.optimizer.step()

    def snapshot():
        inner = worker.optimizer.chained_optimizers[0].optimizer
        moments = [s["exp_avg"].clone() for s in inner.state.values()]
        return [p.detach().clone() for p in worker.bare.parameters()], moments

    step(0)
    ck.save_checkpoint(tmp, worker.sharded_state_dict(), {"hf_config": {}})
    saved = snapshot()
    step(1)
    moved = snapshot()
    worker.load_sharded_state(ck.load_checkpoint(tmp, worker.sharded_state_dict(is_loading=True)))
    loaded = snapshot()
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))  # noqa: E731
    return {"dtypes": dtypes, "restored": same(saved, loaded), "moved": not same(saved, moved)}


def test_bf16_distributed_optimizer_checkpoint_roundtrip(tmp_path):
    for r in run_world(_roundtrip, 2, str(tmp_path / "ckpt")):
        assert r["dtypes"] == {torch.bfloat16}
        assert r["moved"]  # the second step changed the state: the restore did real work
        assert r["restored"]


def _never_stepped(rank, world, tmp, cpu_offload):
    """A bf16 actor saved before its optimizer ever stepped (a PPO actor in the critic's warm-up), loaded into
    a second worker; both then step on the same gradients. Returns whether their weights, moments and step
    counts are equal after that update, and the step count."""
    from megarl.config import ActorConfig, OptimConfig
    from megarl.models import checkpoint as ck
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.engine import MegatronWorker

    initialize_model_parallel(ParallelLayout(dp=world))

    def worker():
        rc = ActorConfig(optim=OptimConfig(lr=1e-2, weight_decay=0.1, cpu_offload=cpu_offload))
        return MegatronWorker(SPEC, ParallelLayout(dp=world), "actor", "preset:random", torch.bfloat16, rc,
                              trainable=True)

    def step(w):
        g = torch.Generator().manual_seed(rank)
        for p in w.model.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
        w.optimizer.step()

    def state(w):
        opt = w.optimizer.chained_optimizers[0] if hasattr(w.optimizer, "chained_optimizers") else w.optimizer
        out = [p.detach().clone() for p in w.bare.parameters()]
        for p in w.bare.parameters():
            if p in opt.model_param_group_index_map:
                tensors = opt._get_main_param_and_optimizer_states(p)
                out += [tensors[k].detach().float().clone() for k in ("param", "exp_avg", "exp_avg_sq")]
        steps = {float(s["step"]) for s in opt.optimizer.state.values()}
        return out, steps

    saved = worker()
    ck.save_checkpoint(tmp, saved.sharded_state_dict(), {"hf_config": {}})
    loaded = worker()
    loaded.load_sharded_state(ck.load_checkpoint(tmp, loaded.sharded_state_dict(is_loading=True)))
    step(saved)
    step(loaded)
    (a, steps_a), (b, steps_b) = state(saved), state(loaded)
    return {"same": all(torch.equal(x, y) for x, y in zip(a, b)), "steps": (steps_a, steps_b)}


@pytest.mark.parametrize("cpu_offload", [0.0, 1.0])
def test_a_never_stepped_optimizer_saves_and_resumes_to_the_same_first_update(tmp_path, cpu_offload):
    """Issue 48: megatron-core's DistributedOptimizer asserted on the empty state of a torch Adam that had never
    stepped (``assert len(steps) == 1``), so a PPO actor could not be saved in the critic's warm-up; with its
    initial state created at build (step 0, zero moments), its checkpoint loads into a new worker whose first
    update equals the saved worker's own, with and without the optimizer's CPU offload."""
    for r in run_world(_never_stepped, 2, str(tmp_path / "ckpt"), cpu_offload):
        assert r["same"] and r["steps"] == ({1.0}, {1.0}), r
