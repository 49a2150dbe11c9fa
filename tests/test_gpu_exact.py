"""GPU check of exact on-policy (``rollout.exact``, issue 46; marked ``gpu``, skipped without CUDA or vllm): with
vLLM in its batch-invariant mode and the trainer's old-log-prob pass on the same kernels, every sampled token's
old log-prob equals vLLM's rollout log-prob bit for bit (``mismatch/exact_tokens_frac`` 1.0), at step 1 and after
every reshard of the updated weights, for the tiny model of :mod:`tests.rl_tasks` and for SmolLM2-135M (real
weights: the default model). Each case is one ``megarl train`` of a few GRPO steps in a 1-rank world
(``perf/gpu_exact.sh`` runs it; the CPU half is tests/test_exact.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm 0.24.0")]

STEPS = 4
GPU = ["rollout.engine=vllm", "model.dtype=bfloat16", "rollout.exact=true", "rollout.gpu_memory_utilization=0.3",
       f"trainer.steps={STEPS}", "trainer.save_every=0", "trainer.progress=false", "validation.enabled=false",
       "trainer.report=false"]


def _overrides(case: str, root) -> list[str]:
    if case == "tiny":  # peaked logits (embeddings x 3): bf16 near-ties would say nothing
        model = make_tiny_model(root / "model", embedding_scale=3.0)
        return [*task_overrides(model, write_prompts(root / "prompts.jsonl", 64), root / "runs", "tiny"),
                "data.prompts_per_step=8", "rollout.n=8", "actor.ppo_mini_batch_size=32", "actor.optim.lr=3e-3"]
    return ["model.path=default", f"run.output_dir={root / 'runs'}", "run.name=smollm2",  # the arithmetic task
            "data.train_files=[" + str(root / "arithmetic" / "train.parquet") + "]", "actor.optim.lr=1e-5"]


@pytest.mark.parametrize("case", ["tiny", "smollm2"])
def test_trainer_logprobs_equal_vllms_bit_for_bit_at_every_step(tmp_path, case):
    history = run_world(train_on_rank, 1, [*_overrides(case, tmp_path), *GPU], timeout_s=900)[0]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    fracs = [h["mismatch/exact_tokens_frac"] for h in history]
    print(f"\nexact on GPU ({case}): exact_tokens_frac by step {fracs}, max |diff| "
          f"{[h['mismatch/abs_diff_max'] for h in history]}, token_mult_prob_error "
          f"{[h['mismatch/token_mult_prob_error'] for h in history]}")
    assert all(h["rollout/exact"] == 1.0 for h in history)
    assert fracs == [1.0] * STEPS, "the trainer's old log-probs differ from vLLM's (the warning names the first)"
    assert all(h["mismatch/abs_diff_max"] == 0.0 and h["mismatch/token_mult_prob_error"] == 1.0 for h in history)
