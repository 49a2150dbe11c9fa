"""The MoE load-balancing (aux) loss and z-loss over the whole mini-batch's real tokens
(:mod:`megarl.models.moe_router`): the actor update's gradient of those losses equals, within 1e-6, an independent
computation over every real token of the mini-batch at once, whatever the micro-batch size, the padding width,
padded or packed micro-batches, and at DP=2, EP=2 (with either token dispatcher), TP=2 with sequence parallelism
and PP=2, with the statistics counted by the update or taken from the old-log-prob pass before it (which then
spares the update its counting pass); the step's metrics equal the reference's values; megatron's own
per-micro-batch loss fails the same comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.config import MoEConfig
from megarl.models.spec import ModelSpec
from tests.distributed import run_world

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
COMPARED = ("router.weight", "layernorm.weight")  # replicated at every layout: compared by global layer name


def _spec(family: str, z_loss: float) -> ModelSpec:
    """A tiny MoE model of ``family``: 8 experts, top-2 (tests/rl_tasks.py's), narrower; a z-loss of ``z_loss``."""
    return ModelSpec(family, vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                     head_dim=8, ffn_hidden_size=16 if family == "mixtral" else 64,  # Mixtral's: the experts'
                     tie_word_embeddings=True, max_position_embeddings=128, eos_token_ids=(1,), num_experts=8,
                     moe_top_k=2, moe_ffn_hidden_size=16, moe_aux_loss_coef=0.01, moe_z_loss_coef=z_loss,
                     shared_expert_ffn_hidden_size=24 if family == "qwen2_moe" else 0)


def _batch(seq_multiple: int):
    """8 sequences of 3 to 30 tokens, right-padded to a multiple of ``seq_multiple``."""
    from megarl.data.batch import build_batch

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 64, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    responses = [torch.randint(2, 64, (int(torch.randint(1, 21, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(8)]
    return build_batch(prompts, responses, [torch.zeros(len(r)) for r in responses], list(range(8)),
                       pad_token_id=0, seq_multiple=seq_multiple)


def _reference(spec: ModelSpec, batch) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients of the compared weights and the metrics, written from scratch: every router's logits of
    every real token of the batch (each sequence run alone, unpadded), the switch loss
    ``coeff * E / (k T^2) * sum_e N_e * sum_t p_te`` and the z-loss ``coeff_z / T * sum_t lse_t^2`` per layer
    over all ``T`` tokens at once, summed over layers."""
    from megarl.models.checkpoint import load_weights
    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(dp=2), seed=0)
    model = build_model(spec, ParallelLayout(dp=2), init_weights=False, attention="sdpa")
    load_weights([model], "preset:random", seed=0)
    model.eval()  # megatron's own aux loss attaches in training only (dropout is off: the same numbers)
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
    inputs = {i: [] for i in range(len(routers))}
    for i, r in enumerate(routers):
        r.register_forward_pre_hook(lambda mod, args, i=i: inputs[i].append(args[0].reshape(-1, args[0].shape[-1])))
    lengths = batch["prompt_lens"] + batch["response_lens"]
    for row, n in zip(batch["input_ids"], lengths.tolist()):
        model(row[None, :n], torch.arange(n)[None], None)
    e, k, loss, metrics = spec.num_experts, spec.moe_top_k, 0.0, {"aux": [], "z": [], "share": []}
    for i, r in enumerate(routers):
        logits = F.linear(torch.cat(inputs[i]), r.weight)
        p = torch.softmax(logits.double(), -1)
        counts = F.one_hot(p.topk(k, -1).indices, e).sum((0, 1)).double()
        t = logits.shape[0]
        aux = e / (k * t * t) * (counts * p.sum(0)).sum()
        z = torch.logsumexp(logits.double(), -1).square().mean()
        loss = loss + spec.moe_aux_loss_coef * aux + spec.moe_z_loss_coef * z
        metrics["aux"].append(float(aux))
        metrics["z"].append(float(z))
        metrics["share"].append(counts / (k * t))
    loss.backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)  # the final norm's: none
             for n, p in model.named_parameters() if n.endswith(COMPARED)}
    share = torch.stack(metrics["share"])
    return grads, {"moe_aux_loss": sum(metrics["aux"]) / len(routers), "moe_z_loss": sum(metrics["z"]) / len(routers),
                   "moe_expert_load_max": float(share.max()), "moe_expert_load_min": float(share.min())}


def _update(spec: ModelSpec, batch, layout: dict, rc_kwargs: dict, megatron_loss: bool = False,
            after_pass: bool = False):
    """One actor update of ``batch`` (one mini-batch, no policy-loss gradient) at ``layout``; the compared
    weights' gradients (DDP's reduced ``main_grad``) by global layer name, and the update's metrics.
    ``megatron_loss``: without the mini-batch's statistics (megatron's per-micro-batch loss, no padding mask).
    ``after_pass``: after the old-log-prob pass over ``batch`` (``compute_logprobs``), whose statistics the update
    takes: the metrics then hold ``counting_passes``, how many counting passes the update ran itself."""
    import unittest.mock

    from megatron.core import parallel_state as ps

    from megarl.config import ActorConfig, OptimConfig, ParallelConfig
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers import engine as workers
    from megarl.workers.actor import PolicyWorker

    mesh = ParallelLayout(**layout)
    initialize_model_parallel(mesh, seed=0)
    rc = ActorConfig(parallel=ParallelConfig(**layout, sequence_parallel=mesh.tp > 1), ppo_mini_batch_size=8,
                     optim=OptimConfig(lr=1e-3, clip_grad=0.0, distributed=False), **rc_kwargs)
    actor = PolicyWorker(spec, mesh, "actor", "preset:random", torch.float32, rc, trainable=True,
                         temperature=1.0)
    count_routing, counted = workers.count_routing, []

    def counting(*args):
        counted.append(1)
        return count_routing(*args)

    with unittest.mock.patch.object(workers, "needs_batch_stats", lambda found: not megatron_loss), \
            unittest.mock.patch.object(workers, "count_routing", counting):
        if after_pass:
            actor.compute_logprobs(batch)
            counted.clear()
        [metrics] = actor.train_minibatches(batch, workers.MODEL_INPUTS, lambda mb, out, norms: (out.sum() * 0.0, {}),
                                            epochs=1, seed=0, mean_keys=[], sum_keys=[])
    if after_pass:
        metrics["counting_passes"] = len(counted)
    offset = ps.get_pipeline_model_parallel_rank() * spec.num_layers // mesh.pp

    def global_name(name):
        head, _, rest = name.partition("decoder.layers.")
        layer, _, tail = rest.partition(".")
        return f"{head}decoder.layers.{int(layer) + offset}.{tail}" if rest else name

    grads = {global_name(n): p.main_grad.clone() for n, p in actor.bare.named_parameters() if n.endswith(COMPARED)}
    return grads, metrics


def _error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest |difference| over the compared gradients, relative to the reference's largest entry."""
    scale = max(float(g.abs().max()) for g in ref.values())
    return max(float((g - ref[n]).abs().max()) for n, g in grads.items()) / scale


# (family, z-loss coefficient, layout, worker config, batch padding multiple); TP=2 runs with sequence parallelism
CASES = [(f, z, {"dp": 2}, rc, m) for f, z in zip(FAMILIES, (1e-3, 0.0, 0.0))
         for rc, m in [({"micro_batch_size": 1}, 8), ({"micro_batch_size": 4}, 32),
                       ({"max_tokens_per_micro_batch": 40, "sequence_packing": True}, 8)]]
ALLGATHER = MoEConfig(token_dispatcher="allgather")  # at EP=2 (the all-to-all one otherwise)
CASES += [("qwen3_moe", 1e-3, {"dp": 2, "ep": 2}, {"micro_batch_size": 2}, 8),
          ("qwen3_moe", 1e-3, {"dp": 2, "ep": 2}, {"micro_batch_size": 2, "moe": ALLGATHER}, 8),
          ("qwen3_moe", 1e-3, {"tp": 2}, {"micro_batch_size": 2}, 16),
          ("qwen3_moe", 1e-3, {"pp": 2}, {"micro_batch_size": 2}, 8),
          ("qwen3_moe", 1e-3, {"dp": 2}, {"max_tokens_per_micro_batch": 64}, 8)]
# the statistics of the old-log-prob pass (forward micro-batches of another size), taken by the update
PASS_CASES = [("qwen3_moe", 1e-3, {"dp": 2}, {"micro_batch_size": 1, "logprob_micro_batch_size": 4}, 8),
              ("qwen3_moe", 1e-3, {"tp": 2}, {"micro_batch_size": 2, "logprob_micro_batch_size": 8}, 16),
              ("mixtral", 0.0, {"pp": 2}, {"micro_batch_size": 2, "logprob_micro_batch_size": 4}, 8)]


def _run_cases(rank, world):
    out, refs = [], {}
    for after_pass, cases in ((False, CASES), (True, PASS_CASES)):
        for family, z, layout, rc, multiple in cases:
            spec, batch = _spec(family, z), _batch(multiple)
            if (family, z) not in refs:
                refs[family, z] = _reference(spec, _batch(8))
            grads, metrics = _update(spec, batch, layout, rc, after_pass=after_pass)
            out.append(((family, layout, rc, multiple, after_pass), _error(grads, refs[family, z][0]), metrics,
                        refs[family, z][1]))
    # the negative control: megatron's loss per micro-batch, over every position of the padded micro-batches
    spec = _spec("qwen3_moe", 0.0)
    ref = _reference(spec, _batch(8))[0]
    grads, _ = _update(spec, _batch(32), {"dp": 2}, {"micro_batch_size": 1}, megatron_loss=True)
    return out, _error(grads, ref)


def test_aux_loss_gradient_is_the_whole_mini_batch_s_at_every_layout():
    for out, control in run_world(_run_cases, 2):
        for case, error, metrics, ref in out:
            assert error <= 1e-6, (case, error)
            assert metrics.get("counting_passes", 0) == 0, case  # after a pass, its statistics were taken
            for key in ("moe_aux_loss", "moe_expert_load_max", "moe_expert_load_min"):
                assert abs(metrics[key] - ref[key]) <= 1e-6 * abs(ref[key]), (case, key, metrics[key], ref[key])
            if "moe_z_loss" in metrics:
                assert abs(metrics["moe_z_loss"] - ref["moe_z_loss"]) <= 1e-6 * ref["moe_z_loss"], case
        assert control > 1e-2, control  # megatron's per-micro-batch loss gives another gradient
