"""An MoE layer's routed experts as two grouped GEMMs: a drop-in for megatron-core's ``SequentialMLP``.

megatron-core 0.19's local layer spec runs the experts of a rank one after the other (``SequentialMLP``: a Python
loop of one ``MLP`` per expert, two small GEMMs each); its grouped experts (``TEGroupedMLP``) need Transformer
Engine. :class:`GroupedExperts` runs all the rank's experts in one ``torch.nn.functional.grouped_mm`` for the
gate and up projections and one for the down projection over the tokens sorted by expert (the grouped GEMM of
MegaBlocks, Gale et al. 2022, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts", as torchtitan's
``GroupedExperts`` calls it: weights ``[E, out, in]`` passed transposed, group ends ``offs``).

It computes what ``SequentialMLP`` computes, in the same order (megatron-core 0.19's ``SequentialMLP.forward`` and
``MLP.forward`` without fusions): with ``moe_apply_probs_on_input`` the probabilities scale the input (cast back
to its dtype) and are then 1; ``h = x W1_e^T`` with ``W1_e = [gate_e; up_e]``; ``h = silu(gate) * up`` (megatron's
GLU: ``activation_func(first half) * (second half + glu_linear_offset)``); ``h = (h * p).to(h.dtype)`` with the
token's routing probability ``p`` (so in the probabilities' dtype, then cast back); ``y = h W2_e^T``.

Its checkpoint is ``SequentialMLP``'s, key for key (each local expert a shard of the global expert axis, gate and
up halves of ``linear_fc1`` split as megatron's SwiGLU factory splits them, the same replica ids), so
distributed checkpoints, optimizer state included, load across the two.

This package sits beside ``megarl.models`` in the import order: it imports torch and megatron-core only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint


def misaligned_sizes(hidden_size: int, moe_ffn_hidden_size: int, dtype: torch.dtype) -> dict[str, int]:
    """The sizes that ``grouped_mm`` cannot take, with the multiple each must be of, or {} where it can.

    ``grouped_mm`` needs every operand's row stride to be a multiple of 16 bytes ("strides should be multiple of
    16 bytes"; torch 2.11, CPU and CUDA): the tokens' and the weights' rows hold ``hidden_size`` or
    ``moe_ffn_hidden_size`` elements (``2 * moe_ffn_hidden_size`` for the gate and up weights), so each must be
    a multiple of 4 elements in fp32, of 8 in bf16 and fp16.
    """
    multiple = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    sizes = {"hidden_size": hidden_size, "moe_ffn_hidden_size": moe_ffn_hidden_size}
    return {name: multiple for name, size in sizes.items() if size % multiple}


class _ExpertWeights(torch.nn.Module):
    """One stacked weight of the experts, under the name megatron's linear layers give theirs (``weight``)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device | None, stride: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))
        # as megatron's expert linear layers mark theirs (expert TP = 1: each rank's shard is whole): reduced over
        # the expert data-parallel group, not all-reduced over DP
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=stride)
        self.weight.allreduce = False


class GroupedExperts(MegatronModule):
    """The ``num_local_experts`` routed experts of one MoE layer on this expert-parallel rank, as grouped GEMMs.

    Built like ``SequentialMLP`` (megatron's ``MoELayer`` calls ``experts(num_local_experts, config,
    pg_collection=...)``). Expert TP is 1 (each rank holds its experts whole).

    Parameters (``E``: local experts, ``H``: hidden size, ``F``: ``moe_ffn_hidden_size``; the config's
    ``params_dtype``), stored 2-D with the experts stacked on rows (their layout in
    :mod:`megarl.models.layout_megatron` and vLLM's ``w13_weight`` / ``w2_weight`` viewed 2-D), and viewed 3-D in
    the GEMMs:
        ``linear_fc1.weight``: ``[E * 2F, H]``, expert ``e``'s rows ``[gate_e; up_e]`` (``SequentialMLP``'s
        ``local_experts.{e}.linear_fc1.weight``, concatenated over ``e``).
        ``linear_fc2.weight``: ``[E * H, F]``, expert ``e``'s down projection in rows ``[e * H, (e + 1) * H)``.

    Raises:
        ValueError: a config it does not compute as ``SequentialMLP`` does: biases, a non-gated or non-SiLU
            activation, fused bias-activation, an activation clamp, FP8/FP4, a latent MoE size, or expert TP > 1;
            sizes that ``grouped_mm`` cannot take (:func:`misaligned_sizes`).
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None):
        super().__init__(config=config)
        unsupported = {"add_bias_linear": config.add_bias_linear, "gated_linear_unit": not config.gated_linear_unit,
                       "activation_func": config.activation_func is not F.silu,
                       "bias_activation_fusion": config.bias_activation_fusion,
                       "activation_func_clamp_value": config.activation_func_clamp_value is not None,
                       "fp8": bool(config.fp8), "fp4": bool(config.fp4),
                       "moe_latent_size": config.moe_latent_size is not None,
                       "expert_tensor_parallel_size": pg_collection.expt_tp.size() > 1}
        if any(unsupported.values()):
            raise ValueError(f"GroupedExperts computes SequentialMLP's plain SwiGLU experts only; unsupported: "
                             f"{[k for k, v in unsupported.items() if v]}")
        misaligned = misaligned_sizes(config.hidden_size, config.moe_ffn_hidden_size, config.params_dtype)
        if misaligned:
            raise ValueError(f"GroupedExperts: torch's grouped_mm needs rows of a multiple of 16 bytes; in "
                             f"{config.params_dtype} these sizes are not multiples of the number given: {misaligned}")
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.dp_group = pg_collection.expt_dp
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.linear_fc1 = _ExpertWeights(num_local_experts * 2 * f, h, config.params_dtype, device, stride=2)
        self.linear_fc2 = _ExpertWeights(num_local_experts * h, f, config.params_dtype, device, stride=1)
        if config.perform_initialization:
            with torch.no_grad():
                for w, init in ((self.linear_fc1.weight, config.init_method),
                                (self.linear_fc2.weight, config.output_layer_init_method)):
                    for expert in w.chunk(num_local_experts):
                        init(expert)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The experts' outputs of the tokens sorted by expert.

        Args:
            permuted_local_hidden_states: ``[T, H]`` (params dtype), the tokens of local expert 0, then 1, ...
            tokens_per_expert: ``[E]`` (int64, any device), how many of the ``T`` tokens each expert takes (0
                allowed; they sum to ``T``, which may be 0).
            permuted_probs: ``[T]``, each token's routing probability (fp32 or the params dtype).

        Returns:
            ``([T, H]`` in the dtype of the input, ``None``): no bias, as ``SequentialMLP`` returns.
        """
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input works with moe_router_topk=1 only")
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        e = self.num_local_experts
        offs = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)
        w1 = self.linear_fc1.weight.view(e, -1, x.shape[-1])  # [E, 2F, H]
        gate, up = F.grouped_mm(x, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        h = self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
        h = (h * probs.unsqueeze(-1)).to(h.dtype)
        w2 = self.linear_fc2.weight.view(e, x.shape[-1], -1)  # [E, H, F]
        return F.grouped_mm(h, w2.transpose(1, 2), offs=offs), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict:
        """``SequentialMLP``'s sharded state dict: under ``{prefix}experts.linear_fc1.weight`` (and ``fc2``), local
        expert ``j`` is global expert ``g = ep_rank * E + j`` of an axis of ``E * ep`` prepended after
        ``sharded_offsets``; ``linear_fc1``'s gate and up rows are the two halves of its row axis (megatron's SwiGLU
        factory); replica id ``(0, 0, expert-DP rank)``; each expert's linear layers' (empty) extra state too. One
        :class:`ShardedTensorFactory` per stacked weight builds the per-expert shards (of the weight or of an
        optimizer state of its shape) and stacks them back on load."""
        ep_rank, e = self.ep_group.rank(), self.num_local_experts
        ax, global_experts = len(sharded_offsets), e * self.ep_group.size()
        replica_id = (0, 0, self.dp_group.rank())

        def expert_offsets(j: int) -> tuple:
            return (*sharded_offsets, (ax, ep_rank * e + j, global_experts))

        def build(halves: int):
            @torch.no_grad()
            def build_fn(key, t, replica, flattened_range):
                return [[ShardedTensor.from_rank_offsets(key, part, *expert_offsets(j), (ax + 1, k, halves),
                                                         replica_id=replica, prepend_axis_num=ax + 1)
                         for k, part in enumerate(expert.chunk(halves))]
                        for j, expert in enumerate(t.chunk(e))]
            return build_fn

        def merge_fn(loaded):
            return torch.cat([part for expert in loaded for part in expert])

        out = {}
        for name, halves in (("linear_fc1", 2), ("linear_fc2", 1)):
            out[f"{prefix}{name}.weight"] = ShardedTensorFactory(f"{prefix}experts.{name}.weight",
                                                                 getattr(self, name).weight, build(halves),
                                                                 merge_fn, replica_id)
            for j in range(e):
                out[f"{prefix}local_experts.{j}.{name}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{name}._extra_state", expert_offsets(j), replica_id)
        return out
