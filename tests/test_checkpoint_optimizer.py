"""Trainer checkpoints of a bf16 actor with megatron's DistributedOptimizer over DP=2: every parameter is
bf16 (the local spec's torch norm would keep fp32 weights and break megatron's bucket layout), and a
checkpoint restores parameters, fp32 main parameters and Adam moments exactly."""

from __future__ import annotations

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
