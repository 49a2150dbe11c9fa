"""GRPO with a LoRA actor (``actor.lora``) on the synthetic task of :mod:`tests.rl_tasks`, fp32 on the CPU: it learns
the task (reward above 0.8), the reference is the actor's base (KL in the loss), samples record their adapter
version, the checkpoint holds the adapters alone and names the base, ``megarl export`` writes the merged model and
a PEFT adapter that ``peft`` loads on the base and that reproduces the actor's logits, and a checkpoint resumed at
another layout (TP=2 -> TP=1) matches the uninterrupted run.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_world
from tests.rl_tasks import make_tiny_model, task_overrides, train_on_rank, write_prompts

LORA = ["actor.lora.rank=8", "actor.lora.alpha=16"]
LEARN = ["trainer.steps=16", "trainer.save_every=0", "data.prompts_per_step=8", "rollout.n=8",
         "actor.ppo_mini_batch_size=32", "actor.micro_batch_size=16", "actor.optim.lr=2e-2"] + LORA
RESUME = ["data.prompts_per_step=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
          "actor.optim.lr=1e-2", "actor.optim.warmup_steps=2", "trainer.save_every=1", "algorithm.kl.coef=0"] + LORA
COMPARED = ["reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/lr"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "model", embedding_scale=3)  # logits a frozen output layer can sharpen
    data = write_prompts(root / "prompts.jsonl", 64)
    return root, model, data


def _run(task, name, world=1, extra=()):
    root, model, data = task
    return run_world(train_on_rank, world, task_overrides(model, data, root / "runs", name) + list(extra))


def _actor_logits(rank, world, ckpt, tokens):
    """The LoRA actor's logits ``[b, s, vocab]`` from its checkpoint (base + adapters), TP=1."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.models import checkpoint as ck
    from megarl.models.convert import checkpoint_lora
    from megarl.models.megatron import build_model
    from megarl.models.pipeline import run_microbatches
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    spec = ck.checkpoint_spec(ckpt)
    mesh = ParallelLayout()
    initialize_model_parallel(mesh)
    model = build_model(spec, mesh, init_weights=False, lora=checkpoint_lora(ckpt)).eval()
    ck.load_model(ckpt, model)
    with torch.no_grad():
        res = run_microbatches(model, [{"input_ids": tokens}], lambda mb, out: (
            out.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(out)[..., :spec.vocab_size]}),
            forward_only=True)
    return res[0]["logits"]


@pytest.mark.slow  # CI time (45 minutes): one of the 30 slowest of the default tier
def test_grpo_with_lora_learns_the_task_and_exports_a_peft_adapter(task):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.launch.convert import export_to_hf
    from megarl.models.checkpoint import read_meta

    root, model, _ = task
    history = _run(task, "lora", extra=LEARN)[0]
    rewards = [h["reward/mean"] for h in history]
    assert rewards[0] < 0.3, rewards
    assert max(rewards[-3:]) > 0.8, rewards
    assert all("actor/kl" in h for h in history)  # the reference (the base) in the loss
    run = root / "runs" / "lora"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["adapter_version"] for s in samples] == [s["policy_version"] for s in samples] == \
        [s["step"] - 1 for s in samples]
    ckpt = run / "checkpoints" / "step_000016"
    meta = read_meta(ckpt)
    assert meta["lora"]["base"] == str(model) and meta["lora"]["rank"] == 8
    from megatron.core.dist_checkpointing import load_tensors_metadata

    saved = sorted(load_tensors_metadata(str(ckpt / "model")))
    assert saved and all(k.endswith(("lora_a", "lora_b")) or ".lora_" in k for k in saved), saved  # no base weights

    out = export_to_hf(str(ckpt), str(root / "export"))
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tokens = torch.randint(3, 16, (2, 9), generator=torch.Generator().manual_seed(4))
    actor = run_world(_actor_logits, 1, str(ckpt), tokens)[0]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(out / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        via_peft, via_merged, via_base = (m(tokens).logits for m in (peft_model, merged, base))
    assert torch.allclose(via_peft, actor, rtol=1e-4, atol=1e-5), (via_peft - actor).abs().max()
    assert torch.allclose(via_merged, actor, rtol=1e-4, atol=1e-5), (via_merged - actor).abs().max()
    assert (via_base - actor).abs().max() > 1e-2  # the adapters changed the model: the checks can fail


@pytest.mark.slow  # CI time (issue 33's 45 minutes): one of the 30 slowest
def test_a_lora_checkpoint_resumes_at_another_layout_as_the_uninterrupted_run(task):
    straight = _run(task, "straight", extra=RESUME + ["trainer.steps=3"])[0]
    assert straight[1]["actor/ppo_kl"] != straight[2]["actor/ppo_kl"]
    _run(task, "moved", 2, extra=RESUME + ["trainer.steps=2", "actor.parallel.tp=2"])
    resumed = _run(task, "moved", extra=RESUME + ["trainer.steps=3", "trainer.resume=true"])[0]
    assert [h["step"] for h in resumed] == [1, 2, 3]
    for step in range(3):
        for key in COMPARED:
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-4, abs=1e-6), (step, key)
