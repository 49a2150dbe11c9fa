"""The learning rate each actor update actually uses (read inside the optimizer's step), through warm-up and
decay: update k of a warm-up of W runs at lr * k / W, never at 0 (issue 8)."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world
from tests.rl_tasks import update_batch

SPEC = ModelSpec("llama", 64, 32, 1, 4, 2, 16, 64, tie_word_embeddings=True)
LR, UPDATES = 1e-3, 6


CASES = [
    (3, "constant", [LR / 3, 2 * LR / 3, LR, LR, LR, LR]),
    (1, "constant", [LR] * UPDATES),                                   # a warm-up of one update is none
    (0, "linear", [LR * (1 - k / UPDATES) for k in range(UPDATES)]),   # no warm-up: as before
    # warm-up of 2, then linear decay over the remaining updates: (k - 2) / (6 - 2 + 1) of the way to 0
    (2, "linear", [LR / 2, LR] + [LR * (1 - (k - 2) / 5) for k in range(3, UPDATES + 1)]),
]


def _used_lrs(rank, world):
    """Per case: the LR each of the UPDATES updates used (read by a hook inside the optimizer's step) and the
    ``lr`` metric it reported."""
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, OptimConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker

    layout = ParallelLayout()
    initialize_model_parallel(layout)
    batch = update_batch(2 * UPDATES, 60)  # one update per mini-batch of 2
    results = []
    for warmup, decay, _ in CASES:
        rc = ActorConfig(optim=OptimConfig(lr=LR, warmup_steps=warmup, decay=decay), micro_batch_size=2,
                         ppo_mini_batch_size=2)
        worker = PolicyWorker(SPEC, layout, "actor", "preset:random", torch.float32, rc, trainable=True,
                              total_updates=UPDATES, temperature=1.0)
        used = []
        for opt in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
            opt.optimizer.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
        history = worker.update(batch, AlgorithmConfig(kl=KLConfig(coef=0.0)), seed=0)
        results.append((used, [h["lr"] for h in history]))
    return results


def test_each_update_uses_the_scheduled_lr():
    for (warmup, decay, expected), (used, reported) in zip(CASES, run_world(_used_lrs, 1)[0]):
        assert used == pytest.approx(expected, rel=1e-12), (warmup, decay)
        assert reported == used  # the lr metric is the one the update used
