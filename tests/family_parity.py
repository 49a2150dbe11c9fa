"""The parity harness of the model-family tests (``tests/test_models_<family>.py``).

A tiny random-weight transformers model is the reference (:func:`reference`: its tensors, 2 rows of random tokens,
its logits and the gradients of their cross-entropy). Inside a gloo world (:func:`tests.distributed.run_world`) each
rank builds the megatron-core model of the same spec at a layout and fills it from the reference's tensors
(:func:`load`), then measures the max abs difference of its logits (:func:`logits_diff`) and of a training step's
gradients (:func:`grads_diff`), reshards its tensors back to HF's layout and into vLLM's TP=2 one
(:func:`reshard_checks`), runs the trainer's sdpa attention on padded and packed rows (:func:`sdpa_and_packed`),
zero LoRA adapters (:func:`zero_lora`), and writes the dist checkpoint (:func:`save_dist_checkpoint`,
:func:`save_pp2_checkpoint`) that the test exports back to HF (:func:`export_roundtrip`). Each family's file keeps
what is its own: the spec, the random init, the layouts, the independent slicing of the HF tensors into vLLM's (with
the pieces all families share: :func:`vllm_vocab_shard`, :func:`vllm_mlp_shard`), the tolerances and the extra checks.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.models.spec import ModelSpec
from tests.actor_decoding import gathered_logits_and_loss

SEQ = 24


@dataclasses.dataclass
class Reference:
    """transformers' side of a parity check.

    Attributes:
        sd: canonical name -> whole tensor (fp32), what megarl's models are filled from.
        tokens, targets: ``[2, seq]`` int64 (seeded: every rank draws the same).
        logits: ``[2, seq, vocab]`` fp32, transformers' logits of ``tokens``.
        grads: canonical name -> gradient of the mean cross-entropy of ``targets`` (the routers' score-correction
            bias, a buffer in transformers, zero).
    """

    spec: ModelSpec
    sd: dict
    tokens: torch.Tensor
    targets: torch.Tensor
    logits: torch.Tensor
    grads: dict

    def output_fn(self, train: bool):
        """:func:`tests.actor_decoding.gathered_logits_and_loss` on ``targets``."""
        return gathered_logits_and_loss(self.targets, self.spec.vocab_size, train)

    def diff(self, logits: torch.Tensor) -> float:
        """Max abs difference of ``logits`` (any shape of ``[2 * seq, vocab]`` elements) from transformers'."""
        return (logits.reshape(self.logits.shape) - self.logits).abs().max().item()


def reference(spec: ModelSpec, model, *, seq: int = SEQ, canonical: bool = False) -> Reference:
    """Run the transformers ``model`` of ``spec`` (fp32, eval mode) forward and backward on 2 x ``seq`` random tokens
    (generator seed 7: tokens, then targets).

    Args:
        canonical: the tensors and gradients through :func:`megarl.models.weights.transformers_canonical` (MoE
            models: transformers fuses the experts; the score-correction bias buffers are taken as tensors);
            otherwise the state dict's tensors that the spec names.
    """
    import torch.nn.functional as F

    from megarl.models.weights import transformers_canonical

    v = spec.vocab_size
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, v, (2, seq), generator=gen)
    targets = torch.randint(0, v, (2, seq), generator=gen)
    bias = {n: b for n, b in model.named_buffers() if n.endswith("correction_bias")}
    if canonical:
        sd = transformers_canonical(spec, {**bias, **{n: p.detach() for n, p in model.named_parameters()}})
    else:
        sd = {n: t for n, t in model.state_dict().items() if n in spec.hf_tensor_shapes()}
    model.zero_grad()
    logits = model(tokens).logits
    F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if canonical:
        grads = transformers_canonical(spec, {**{n: torch.zeros_like(b) for n, b in bias.items()}, **grads})
    return Reference(spec, sd, tokens, targets, logits.detach(), grads)


def load(spec: ModelSpec, mesh, ref: Reference, rank: int, *, fill: bool = True, **build):
    """This rank's megatron model of ``spec`` at ``mesh`` (model parallelism initialised by the caller), built by
    :func:`megarl.models.megatron.build_model` with ``build`` and filled from ``ref.sd`` (unless not ``fill``: the
    caller loads it, e.g. by :func:`save_dist_checkpoint`).

    Returns:
        ``(model, local, params)``: the model, its local tensors as the layout describes them (name ->
        :class:`~megarl.models.layout.LocalTensor`, without the adapters of ``build["lora"]``) and its parameters.
    """
    from megatron.core import parallel_state as ps

    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader

    model = build_model(spec, mesh, **build)
    local = megatron_rank_tensors(spec, mesh, ps.get_tensor_model_parallel_rank(),
                                  ps.get_pipeline_model_parallel_rank(), ep_rank=mesh.ep_rank(rank),
                                  moe_experts=build.get("moe_experts", "grouped"))
    params = dict(model.named_parameters())
    if fill:
        fill_local_tensors(local, params, state_dict_reader(ref.sd, spec.hf_tensor_shapes()))
    return model, local, params


def names_match(params: dict, local: dict) -> bool:
    """Whether the model's parameters are the layout's local tensors, names and shapes."""
    return {n: tuple(p.shape) for n, p in params.items()} == {n: tuple(lt.shape) for n, lt in local.items()}


def logits_diff(model, ref: Reference, mb: dict | None = None) -> float | None:
    """Max abs difference of the model's logits (gathered over TP, eval mode) on ``mb`` (default: ``ref.tokens``)
    from transformers'; None off the last pipeline stage."""
    from megarl.models.pipeline import run_microbatches

    res = run_microbatches(model.eval(), [mb or {"input_ids": ref.tokens}], ref.output_fn(False), forward_only=True)
    return ref.diff(res[0]["logits"]) if res else None


def grads_diff(model, local: dict, params: dict, ref: Reference, *, tp_summed: tuple = (),
               frozen_ok: bool = False) -> float:
    """One training step of the cross-entropy of ``ref.targets``: the max abs difference of every block of every
    local gradient from transformers'.

    Args:
        tp_summed: name parts of the parameters whose gradients megatron's ``finalize_model_grads`` sums over TP
            (summed here).
        frozen_ok: leave out the parameters that do not require a gradient (otherwise one fails the check).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.models.pipeline import run_microbatches

    run_microbatches(model.train(), [{"input_ids": ref.tokens}], ref.output_fn(True), forward_only=False)
    for n, p in params.items():
        if any(s in n for s in tp_summed):
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    return max(((params[n].grad[b.dst_box] - ref.grads[b.name][b.src_box]).abs().max().item()
                for n, lt in local.items() if not frozen_ok or params[n].requires_grad for b in lt.blocks),
               default=0.0)


def reshard(params: dict, src, dst, rank: int) -> dict:
    """This rank's tensors of layout ``dst`` written by the reshard from ``params`` (laid out as ``src``)."""
    from megarl.reshard.executor import execute_plan
    from megarl.reshard.planner import plan_reshard

    got = {n: torch.zeros(lt.shape) for n, lt in dst.tensors(rank).items()}
    execute_plan(plan_reshard(src, dst), params, got)
    return got


def reshard_checks(spec: ModelSpec, mesh, params: dict, sd: dict, want: dict, rank: int, world: int, *,
                   reshape: bool = False, **layout) -> dict:
    """megarl's tensors of this rank resharded back to whole HF tensors and into vLLM's TP=2 layout.

    Args:
        want: this rank's vLLM tensors as the test slices them from the HF ones.
        reshape: compare a vLLM tensor with ``want``'s after viewing it in ``want``'s shape.
        layout: :func:`~megarl.models.layout_megatron.megatron_layout`'s keyword arguments.

    Returns:
        ``hf_bad`` (names of ``sd`` not bit-identical back), ``vllm_missing`` / ``vllm_extra`` (names of ``want``
        vLLM's layout lacks / names it holds beyond ``want``), ``vllm_bad`` (names of both not bit-identical).
    """
    from megarl.models.layout import hf_layout
    from megarl.models.layout_megatron import megatron_layout
    from megarl.models.layout_vllm import vllm_layout

    src = megatron_layout(spec, mesh, **layout)
    back = reshard(params, src, hf_layout(spec, range(world)), rank)
    got = reshard(params, src, vllm_layout(spec, 2, range(world)), rank)
    return {"hf_bad": [n for n in sd if not torch.equal(back[n], sd[n])],
            "vllm_missing": sorted(set(want) - set(got)), "vllm_extra": sorted(set(got) - set(want)),
            "vllm_bad": [n for n in want if n in got and not torch.equal(
                got[n].reshape(want[n].shape) if reshape else got[n], want[n])]}


def zero_lora(spec: ModelSpec, mesh, ref: Reference, local: dict, lora, **build) -> dict:
    """The model with LoRA adapters ``lora`` (zero) at ``mesh`` (pipeline stage 0), its base weights from
    ``ref.sd`` through the layout ``local`` of the model without adapters.

    Returns:
        ``lora_names`` (the model's parameters are the LoRA layout's, names and shapes), ``lora_adapters`` (the
        adapter parameters' names, sorted), ``logits`` (:func:`logits_diff`) and ``model``.
    """
    from megatron.core import parallel_state as ps

    from megarl.models.layout_megatron import megatron_rank_tensors
    from megarl.models.megatron import build_model
    from megarl.models.weights import fill_local_tensors, state_dict_reader

    adapted = build_model(spec, mesh, lora=lora, **build).eval()
    lora_local = megatron_rank_tensors(spec, mesh, ps.get_tensor_model_parallel_rank(), 0, lora=lora,
                                       moe_experts=build.get("moe_experts", "grouped"))
    params = dict(adapted.named_parameters())
    fill_local_tensors(local, params, state_dict_reader(ref.sd, spec.hf_tensor_shapes()))
    return {"lora_names": names_match(params, lora_local), "lora_adapters": sorted(n for n in params if "lora_" in n),
            "logits": logits_diff(adapted, ref), "model": adapted}


def sdpa_and_packed(spec: ModelSpec, ref: Reference, world: int, *, restart_positions: bool) -> dict:
    """The trainer's sdpa attention at TP=1 (model parallelism initialised here), on ``ref.tokens``' padded rows
    (``"sdpa"``) and on both rows packed in one (``"packed"``, ``cu_seqlens`` at the cut; the positions restarting at
    the second sequence, as :func:`megarl.workers.packing.pack_rows` packs them, or running on): the max abs
    differences of the logits from transformers'."""
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    mesh = ParallelLayout(tp=1, pp=1, dp=world)
    initialize_model_parallel(mesh)
    model, _, _ = load(spec, mesh, ref, 0, attention="sdpa")
    seq = ref.tokens.shape[1]
    positions = torch.arange(seq).repeat(2) if restart_positions else torch.arange(2 * seq)
    packed = {"input_ids": ref.tokens.reshape(1, -1), "position_ids": positions.unsqueeze(0),
              "cu_seqlens": torch.tensor([0, seq, 2 * seq], dtype=torch.int32)}
    return {key: logits_diff(model, ref, mb) for key, mb in (("sdpa", {"input_ids": ref.tokens}), ("packed", packed))}


def save_dist_checkpoint(model, spec: ModelSpec, sd: dict, folder: str, rank: int) -> None:
    """``sd`` as HF safetensors (``folder/hf_in``, written by rank 0) loaded into ``model`` (this rank's stage) and
    saved as megarl's dist checkpoint ``folder/mg``: what :func:`export_roundtrip` exports."""
    import torch.distributed as dist

    from megarl.models import checkpoint as ck
    from megarl.models.hf_io import open_hf_checkpoint, save_hf_checkpoint

    if rank == 0:
        save_hf_checkpoint(f"{folder}/hf_in", spec, sd)
    dist.barrier()
    ck.load_hf_weights(model, open_hf_checkpoint(f"{folder}/hf_in"))
    ck.save_model(f"{folder}/mg", model)


def export_roundtrip(spec: ModelSpec, folder: str) -> dict:
    """Export the dist checkpoint ``folder/mg`` of :func:`save_dist_checkpoint` to HF (``folder/hf_out``), assert
    that it holds the spec's tensors, each bit-identical to ``folder/hf_in``'s, and that its config.json is the same
    model; return that config.json."""
    from megarl.launch.convert import export_to_hf
    from megarl.models.hf_io import open_hf_checkpoint, read_hf_config

    export_to_hf(f"{folder}/mg", f"{folder}/hf_out")
    source, back = open_hf_checkpoint(f"{folder}/hf_in"), open_hf_checkpoint(f"{folder}/hf_out")
    assert sorted(back.tensor_names) == sorted(spec.hf_tensor_shapes())
    assert [n for n in spec.hf_tensor_shapes() if not torch.equal(back.read(n), source.read(n))] == []
    config = read_hf_config(f"{folder}/hf_out")
    assert ModelSpec.from_hf_config(config) == spec
    return config


def save_pp2_checkpoint(spec: ModelSpec, sd: dict, folder: str, rank: int) -> None:
    """:func:`save_dist_checkpoint` of the model built at PP=2 (a world of 2; model parallelism initialised here and
    destroyed after)."""
    from megatron.core import parallel_state as ps

    from megarl.models.megatron import build_model
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel

    mesh = ParallelLayout(tp=1, pp=2, dp=1)
    initialize_model_parallel(mesh)
    save_dist_checkpoint(build_model(spec, mesh), spec, sd, folder, rank)
    ps.destroy_model_parallel()


def vllm_vocab_shard(t: torch.Tensor, r: int, padded: int = 1024, tp: int = 2) -> torch.Tensor:
    """vLLM's TP rank ``r`` of ``tp`` of a vocab-parallel tensor ``t`` ``[vocab, hidden]``: the vocab padded with zero
    rows to ``padded`` (vLLM pads it to a multiple of 64), then split evenly."""
    full = torch.zeros(padded, t.shape[1])
    full[:t.shape[0]] = t
    per = padded // tp
    return full[per * r:per * (r + 1)]


def vllm_mlp_shard(sd: dict, prefix: str, width: int, r: int) -> dict:
    """vLLM's TP rank ``r`` of a dense (SwiGLU / GeGLU) MLP ``prefix`` of HF tensors ``sd``: ``gate_up_proj`` =
    [gate_r; up_r] (``width`` rows each, rows ``[width r, width (r + 1))``), ``down_proj`` those columns."""
    rows = slice(width * r, width * (r + 1))
    return {prefix + "gate_up_proj.weight": torch.cat([sd[prefix + "gate_proj.weight"][rows],
                                                       sd[prefix + "up_proj.weight"][rows]]),
            prefix + "down_proj.weight": sd[prefix + "down_proj.weight"][:, rows]}
