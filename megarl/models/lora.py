"""LoRA adapters on megatron-core's own linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", eq. 3): ``y = W x + (alpha / r) * B A dropout(x)``, with ``A`` ``[r, in]`` and ``B`` ``[out, r]``, ``B = 0``
at the start, ``W`` frozen.

The adapted layers are megatron's classes with an adapter added (subclasses that the layer spec puts in place of
``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` and, optionally, the experts' ``linear_fc1`` /
``linear_fc2``: :func:`megarl.models.megatron.layer_spec`), so the base weight keeps its name, shape, TP sharding and
checkpoint keys; the adapters are the module's parameters ``lora_a`` and ``lora_b``.

How the factors are split over TP, so that the adapter needs no collective of its own on the local layer spec:

- **column-parallel** (``linear_qkv``, ``linear_fc1``: the output split over TP): ``B`` is split like ``W``'s rows
  (its rows are ``W``'s rows: the query groups, ``[gate_r; up_r]``), ``A`` is whole on every TP rank. The layer's
  input communication is done once for both paths: the sequence-parallel all-gather (backward: reduce-scatter), or
  without sequence parallelism the identity whose backward all-reduces the input gradient; the base GEMM and the
  adapter both read that input and their input gradients are summed before that one collective. ``A``'s gradient
  is then a partial sum on each TP rank (each rank's ``B_r^T dy_r``): it is summed over TP once per optimizer step,
  with the gradients (:func:`reduce_partial_grads`, called before megatron's ``finalize_model_grads``; the
  sequence-parallel norms' gradients are summed the same way by megatron).
- **row-parallel** (``linear_proj``, ``linear_fc2``: the input split over TP): ``A`` is split like ``W``'s
  columns, ``B`` is whole. ``B A_r x_r`` is added to the base's partial sum ``W_r x_r`` before the layer's one
  all-reduce (or, with sequence parallelism, reduce-scatter), which therefore sums both; ``B``'s gradient is a
  partial sum per TP rank, summed like ``A``'s above.
- **experts** (expert TP = 1): both factors whole, no communication (megatron's experts have none either); their
  gradients are reduced over the expert data-parallel group like the experts' weights.

Transformer Engine's layers (:func:`te_lora_modules`, GPU) fuse their own communication into their GEMMs, so the
adapter takes what TE exposes: with sequence parallelism the column-parallel layers return their all-gathered
normalised input (``return_layernorm_output_gathered``: TE adds its gradient before its own reduce-scatter, so
nothing is added there); without it, and on the row-parallel layers, the adapter's rank-``r`` activations take one
all-reduce (or reduce-scatter) of their own, ``r / hidden`` the size of the layer's.

The adapters are initialised by :func:`megarl.models.weights.init_adapters` (``A`` Kaiming-uniform as PEFT, ``B``
zero, from the canonical tensors, so the same at every layout). :func:`adapters_disabled` switches every adapter
off: the layers then run megatron's own forward, bit for bit the base model (the reference policy of a LoRA run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, NamedTuple

import torch
import torch.nn.functional as F

from megarl.config import LORA_TARGETS
from megarl.models.spec import SpecError

MERGE_CHUNK_BYTES = 64 << 20  # fp64 bytes of W + B A that one merge step computes at once
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ADAPTER_NAMES = ("lora_a", "lora_b")  # the adapted module's parameter names


@dataclass(frozen=True)
class LoRASpec:
    """Which layers get adapters, and their shape.

    Attributes:
        rank: ``r``, the adapters' inner width, >= 1.
        alpha: the scale's numerator: the adapter's output is multiplied by ``alpha / rank``.
        dropout: dropout probability on the adapter's input (training only), in [0, 1).
        target_modules: megatron module names among :data:`LORA_TARGETS` (attention ``linear_qkv`` and output
            ``linear_proj``, MLP ``linear_fc1`` (gate and up) and ``linear_fc2`` (down)).
        experts: the routed experts' ``linear_fc1`` / ``linear_fc2`` too (mixture-of-experts models, local spec).

    Raises:
        SpecError: a field outside its range, or an unknown or missing target module.
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS
    experts: bool = False

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.rank < 1:
            raise SpecError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise SpecError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise SpecError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown or not self.target_modules:
            raise SpecError(f"LoRA target_modules {list(self.target_modules)}: choose among {list(LORA_TARGETS)}")

    @classmethod
    def from_config(cls, config) -> "LoRASpec | None":
        """The spec of a config section with ``rank``, ``alpha``, ``dropout``, ``target_modules`` and ``experts``
        (``actor.lora``); None when its rank is 0 (no LoRA)."""
        if not config.rank:
            return None
        return cls(config.rank, config.alpha, config.dropout, tuple(config.target_modules), config.experts)

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of the adapter's output."""
        return self.alpha / self.rank

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}


class _Adapter:
    """What the adapted megatron layers add: the factors ``lora_a`` ``[r, in_local]`` and ``lora_b``
    ``[out_local, r]`` (in the layer's dtype and device), the scale, the switch, and the adapter's forward."""

    lora_enabled: bool

    def _add_adapter(self, lora: LoRASpec, in_local: int, out_local: int, *, column: bool, split: bool,
                     partial_grad: bool, swiglu: bool) -> None:
        """``column``: a column-parallel layer (else row-parallel); ``split``: its factor split over TP (``B``
        column-parallel, ``A`` row-parallel; else both whole);
        ``partial_grad``: the other factor's gradient is a partial sum over TP (summed by
        :func:`reduce_partial_grads`); ``swiglu``: ``lora_b``'s rows are ``[gate_r; up_r]`` (checkpointed as
        megatron checkpoints ``linear_fc1.weight``)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        w = self.weight
        split = ("b" if column else "a") if split else None
        self.lora_a = torch.nn.Parameter(torch.zeros(lora.rank, in_local, dtype=w.dtype, device=w.device))
        self.lora_b = torch.nn.Parameter(torch.zeros(out_local, lora.rank, dtype=w.dtype, device=w.device))
        for name, p in (("a", self.lora_a), ("b", self.lora_b)):
            set_tensor_model_parallel_attributes(p, split == name, 0 if name == "b" else 1, 1)
            p.megarl_lora = True
            p.megarl_lora_partial_grad = partial_grad and split is not None and split != name
            if hasattr(w, "allreduce"):  # experts: reduced over the expert data-parallel group, as their weights
                p.allreduce = w.allreduce
        self.lora_scale = lora.scale
        self.lora_dropout = lora.dropout
        self.lora_swiglu = swiglu
        self._lora_column = column
        self.lora_enabled = True

    def _lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scale * B A dropout(x)``: ``[..., in_local]`` -> ``[..., out_local]``, in ``x``'s dtype."""
        if self.lora_dropout and self.training:
            x = F.dropout(x, self.lora_dropout)
        return F.linear(F.linear(x, self.lora_a), self.lora_b) * self.lora_scale

    def _lora_sharded_state_dict(self, prefix: str, sharded_offsets, metadata, tp_group) -> dict:
        """megatron's sharded state dict of the layer with its adapters: the weight (and a column-parallel
        bias) and the split factor sharded over TP like the weight, the whole factor replicated; ``lora_b`` of a
        gated ``linear_fc1`` cut into its gate and up halves, as megatron's MLP does for the weight (so the
        checkpoint is the same at every TP)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 0, "bias": 0, "lora_b": 0} if self._lora_column else {"weight": 1, "lora_a": 1}
        sharded = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                      sharded_offsets, tp_group=tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"])
        if self.lora_swiglu:
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_b"
            sharded[key] = apply_swiglu_sharded_factory(
                sharded[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False),
                tp_group=tp_group, dp_group=metadata["dp_cp_group"])
        return sharded


@functools.lru_cache(maxsize=1)
def _local_classes() -> tuple[type, type]:
    """The adapted ``ColumnParallelLinear`` and ``RowParallelLinear`` of the local layer spec (made once)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region,
                                                        reduce_from_tensor_model_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)

    class LoRAColumnParallelLinear(_Adapter, ColumnParallelLinear):
        """megatron's ``ColumnParallelLinear`` with a LoRA adapter (``B`` split with the output, ``A`` whole).

        Shapes: input ``[s, b, in]`` (``[s / tp, b, in]`` under sequence parallelism), output ``[s, b, out / tp]``,
        as megatron's. Extra keyword: ``lora`` (:class:`LoRASpec`), ``swiglu`` (a gated ``linear_fc1``).
        """

        def __init__(self, input_size: int, output_size: int, *, lora: LoRASpec, swiglu: bool = False, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            if self.gather_output:
                raise SpecError("LoRA on a ColumnParallelLinear that gathers its output is not supported")
            tp_split = not self.explicit_expert_comm and self.tp_group.size() > 1
            self._add_adapter(lora, input_size, self.output_size_per_partition, column=True, split=tp_split,
                              partial_grad=tp_split, swiglu=swiglu)

        def forward(self, input_, weight=None, runtime_gather_output=None):
            if not self.lora_enabled:
                return super().forward(input_, weight, runtime_gather_output)
            if weight is not None or runtime_gather_output:
                raise SpecError("a LoRA ColumnParallelLinear takes no external weight and gathers no output")
            # the base's input communication, once for the base GEMM and the adapter (module docstring)
            if self.explicit_expert_comm or self.disable_grad_reduce or self.tp_group.size() == 1:
                x = input_
            elif self.sequence_parallel:
                x = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                         group=self.tp_group)
            else:
                x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
            out = self._forward_impl(input=x, weight=self.weight, bias=None if self.skip_bias_add else self.bias,
                                     gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                     allreduce_dgrad=False, sequence_parallel=False, grad_output_buffer=None,
                                     wgrad_deferral_limit=None, tp_group=self.tp_group,
                                     gtp_remat_size=self.gtp_remat_size)
            return out + self._lora_delta(x), (self.bias if self.skip_bias_add else None)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._lora_sharded_state_dict(prefix, sharded_offsets, metadata, self.tp_group)

    class LoRARowParallelLinear(_Adapter, RowParallelLinear):
        """megatron's ``RowParallelLinear`` with a LoRA adapter (``A`` split with the input, ``B`` whole).

        Shapes: input ``[s, b, in / tp]``, output ``[s, b, out]`` (``[s / tp, b, out]`` under sequence parallelism),
        as megatron's. Extra keyword: ``lora`` (:class:`LoRASpec`).
        """

        def __init__(self, input_size: int, output_size: int, *, lora: LoRASpec, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            if not self.input_is_parallel:
                raise SpecError("LoRA on a RowParallelLinear whose input is not split is not supported")
            tp_split = not self.explicit_expert_comm and self.tp_group.size() > 1
            self._add_adapter(lora, self.input_size_per_partition, output_size, column=False, split=tp_split,
                              partial_grad=tp_split, swiglu=False)

        def forward(self, input_):
            if not self.lora_enabled:
                return super().forward(input_)
            partial = self._forward_impl(input=input_, weight=self.weight, bias=None,
                                         gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                         allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                                         grad_output_buffer=None, gtp_remat_size=self.gtp_remat_size)
            partial = partial + self._lora_delta(input_)  # summed with the base's partial sums by one collective
            if self.explicit_expert_comm or self.tp_group.size() == 1:
                out = partial
            elif self.sequence_parallel:
                out = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
            else:
                out = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
            if self.skip_bias_add:
                return out, self.bias
            return (out + self.bias if self.bias is not None else out), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._lora_sharded_state_dict(prefix, sharded_offsets, metadata, self.tp_group)

    return LoRAColumnParallelLinear, LoRARowParallelLinear


@functools.lru_cache(maxsize=1)
def te_lora_modules() -> tuple[type, type]:
    """The adapted ``TELayerNormColumnParallelLinear`` and ``TERowParallelLinear`` of Transformer Engine's layer
    spec (where TE imports; module docstring: their adapters' communication). Checked on the GPU
    (``tests/test_gpu_lora.py``).

    Raises:
        ImportError: Transformer Engine is not installed.
    """
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear, TERowParallelLinear
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        reduce_from_tensor_model_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)

    class TELoRALayerNormColumnParallelLinear(_Adapter, TELayerNormColumnParallelLinear):
        """TE's fused norm + column-parallel GEMM with a LoRA adapter on the normalised input."""

        def __init__(self, input_size: int, output_size: int, *, lora: LoRASpec, swiglu: bool = False, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            tp = self._tp_group.size() if self._tp_group is not None else 1
            self._lora_tp = tp
            # with sequence parallelism TE hands back its gathered input and sums its gradient into its own
            # reduce-scatter: A's gradient is then a partial sum over TP; without it u's gradient is all-reduced
            self._add_adapter(lora, input_size, output_size // tp, column=True, split=tp > 1,
                              partial_grad=tp > 1 and self.sequence_parallel, swiglu=swiglu)

        def forward(self, x):
            if not self.lora_enabled:
                self.return_layernorm_output = False
                return super().forward(x)
            self.return_layernorm_output = True
            self.return_layernorm_output_gathered = bool(self.sequence_parallel)
            out, bias = super().forward(x)
            if self.te_return_bias:  # (out, bias, ln_out)
                out, bias, normed = out
            else:
                out, normed = out
            if self._lora_tp == 1 or self.sequence_parallel:
                return out + self._lora_delta(normed), bias
            if self.lora_dropout and self.training:
                normed = F.dropout(normed, self.lora_dropout)
            u = copy_to_tensor_model_parallel_region(F.linear(normed, self.lora_a), group=self._tp_group)
            return out + F.linear(u, self.lora_b) * self.lora_scale, bias  # u's gradient all-reduced: [s, b, r]

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._lora_sharded_state_dict(prefix, sharded_offsets, metadata, self._tp_group)

    class TELoRARowParallelLinear(_Adapter, TERowParallelLinear):
        """TE's row-parallel GEMM with a LoRA adapter whose rank-``r`` partial sums take their own reduction."""

        def __init__(self, input_size: int, output_size: int, *, lora: LoRASpec, **kwargs):
            super().__init__(input_size, output_size, **kwargs)
            tp = self._tp_group.size() if self._tp_group is not None else 1
            self._lora_tp = tp
            self._add_adapter(lora, input_size // tp, output_size, column=False, split=tp > 1,
                              partial_grad=False, swiglu=False)

        def forward(self, x):
            out, bias = super().forward(x)
            if not self.lora_enabled:
                return out, bias
            if self.lora_dropout and self.training:
                x = F.dropout(x, self.lora_dropout)
            u = F.linear(x, self.lora_a)
            if self._lora_tp > 1:
                u = (reduce_scatter_to_sequence_parallel_region(u, group=self._tp_group) if self.sequence_parallel
                     else reduce_from_tensor_model_parallel_region(u, group=self._tp_group))
            return out + F.linear(u, self.lora_b) * self.lora_scale, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._lora_sharded_state_dict(prefix, sharded_offsets, metadata, self._tp_group)

    return TELoRALayerNormColumnParallelLinear, TELoRARowParallelLinear


def adapt_layer_spec(layer, lora: LoRASpec, *, use_te: bool, gated: bool = True) -> None:
    """Put the adapted linear classes into a GPT layer spec (``get_gpt_layer_local_spec`` /
    ``get_gpt_layer_with_transformer_engine_spec``'s), in place: the targets of ``lora`` in the attention and a
    dense MLP, and with ``lora.experts`` the routed experts' (local spec: ``SequentialMLP``) and the shared
    expert's MLP.

    Raises:
        SpecError: a mixture-of-experts model on the Transformer Engine spec (its grouped and shared experts have
            no adapters yet).
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    column, row = te_lora_modules() if use_te else _local_classes()

    def adapted(name: str, swiglu_ok: bool = True):
        if name not in lora.target_modules:
            return None
        if name in COLUMN_PARALLEL:
            return ModuleSpec(module=column, params={"lora": lora, "swiglu": gated and name == "linear_fc1"
                                                     and swiglu_ok})
        return ModuleSpec(module=row, params={"lora": lora})

    attn = layer.submodules.self_attention.submodules
    for name in ("linear_qkv", "linear_proj"):
        if (cls := adapted(name)) is not None:
            setattr(attn, name, cls)
    mlp = layer.submodules.mlp
    subs = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    if not hasattr(subs, "experts"):  # a dense MLP
        _adapt_mlp(subs, adapted)
        return
    if use_te:
        raise SpecError("LoRA on a mixture-of-experts model runs on the local layer spec (TE's grouped and "
                        "shared experts have no adapters yet); set actor.kernels.transformer_engine=false")
    if lora.experts:
        _adapt_mlp(subs.experts.keywords["submodules"], adapted)
    shared = getattr(subs, "shared_experts", None)
    if shared is not None:
        _adapt_mlp(shared.keywords["submodules"] if isinstance(shared, functools.partial) else shared.submodules,
                   adapted)


def _adapt_mlp(subs, adapted: Callable) -> None:
    for name in ("linear_fc1", "linear_fc2"):
        if (cls := adapted(name)) is not None:
            setattr(subs, name, cls)


def lora_modules(model) -> Iterator[torch.nn.Module]:
    """The adapted layers of a model (or of a list of model chunks, DDP-wrapped or not)."""
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        for module in chunk.modules():
            if isinstance(module, _Adapter):
                yield module


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA factor's (``...lora_a`` / ``...lora_b``)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def freeze_base(model) -> int:
    """``requires_grad=False`` on every parameter but the adapters (before megatron's DDP wraps the model, so
    that the frozen weights get no gradient buffer and no optimizer state). Returns the adapters' element count
    on this rank."""
    n = 0
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        for name, p in chunk.named_parameters():
            p.requires_grad_(is_adapter(name))
            n += p.numel() if is_adapter(name) else 0
    return n


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside the block the adapted layers run megatron's own forward (the base model, bit for bit)."""
    modules = list(lora_modules(model))
    before = [m.lora_enabled for m in modules]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, on in zip(modules, before):
            m.lora_enabled = on


def reduce_partial_grads(model, tp_group) -> None:
    """Sum over ``tp_group`` the gradients that are partial sums per TP rank (the whole factor of an adapted
    layer: module docstring), in their DDP buffers (``main_grad``; ``grad`` without DDP), in one all-reduce. Call after the backward
    passes of an optimizer step and before megatron's ``finalize_model_grads``; no-op at TP = 1."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if tp_group is None or tp_group.size() == 1:
        return
    grads = []
    for p in (p for m in lora_modules(model) for p in (m.lora_a, m.lora_b)):
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        if p.requires_grad and p.megarl_lora_partial_grad and g is not None:
            grads.append(g)
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def finalize_with_partial_grads(finalize: Callable, tp_group_of: Callable[[], object]) -> Callable:
    """``finalize`` (megatron's ``finalize_model_grads``, bound to its groups) preceded by
    :func:`reduce_partial_grads` over the TP group ``tp_group_of()`` returns."""

    def run(model, *args, **kwargs):
        reduce_partial_grads(model, tp_group_of())
        return finalize(model, *args, **kwargs)

    return run


class Merge(NamedTuple):
    """One LoRA merge on a destination rank: ``tensor[rows, cols] = W + scale * B_aux[rows] @ A_aux[a_row:a_row + r,
    cols]``, computed wider than the tensor and rounded to its dtype once (:func:`apply_merges`; built by
    :func:`megarl.models.layout_lora.with_lora_merge`).

    Attributes:
        tensor: the destination tensor (its ``W`` block has arrived in place).
        b_aux / a_aux: the auxiliary local tensors holding the block's rows of ``B`` and columns of ``A``.
        rows / cols: ``(start, count)`` of the block in ``tensor`` (the same rows in ``b_aux``, columns in
            ``a_aux``).
        a_row: the first row of the block's ``A`` in ``a_aux`` (tensors made of several adapted weights with
            their own ``A``, such as fused experts, stack them).
        rank / scale: ``r`` and ``alpha / r``.
    """

    tensor: str
    b_aux: str
    a_aux: str
    rows: tuple[int, int]
    cols: tuple[int, int]
    a_row: int
    rank: int
    scale: float


def _coalesce(merges: tuple[Merge, ...]) -> list[Merge]:
    """Join merges of one tensor whose rows continue each other with the same columns and ``A`` rows (q, k and
    v of ``qkv_proj``; gate and up of ``gate_up_proj``): one product each."""
    out: list[Merge] = []
    for m in merges:
        if out:
            p = out[-1]
            if (p.tensor, p.b_aux, p.a_aux, p.cols, p.a_row) == (m.tensor, m.b_aux, m.a_aux, m.cols, m.a_row) \
                    and p.rows[0] + p.rows[1] == m.rows[0]:
                out[-1] = p._replace(rows=(p.rows[0], p.rows[1] + m.rows[1]))
                continue
        out.append(m)
    return out


def apply_merges(merges: tuple[Merge, ...], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``W + scale * B A`` into each merge's block in place (:class:`Merge`): ``W`` (the block as it is),
    ``B``'s rows and ``A``'s columns (their auxiliary tensors) widened to fp64 (exact), the product and the sum
    there, one rounding to the tensor's dtype; at most ``MERGE_CHUNK_BYTES`` of fp64 per product. fp64 rather than
    fp32 because an fp32 sum of the ``r`` products depends on how the matmul blocks the tensor (measured: one ulp
    between a whole tensor and its TP column halves); in fp64 every engine rank's shard and an independent
    whole-tensor merge round to the same bits.

    Args:
        merges: the merges (e.g. a destination layout's :attr:`~megarl.models.layout.Layout.merges` of a rank).
        tensors: the merged tensors and the auxiliary ones, by the names the merges give.
    """
    with torch.no_grad():
        for m in _coalesce(merges):
            t, b, a = tensors[m.tensor], tensors[m.b_aux], tensors[m.a_aux]
            (r0, rows), (c0, cols) = m.rows, m.cols
            a_block = a[m.a_row:m.a_row + m.rank, c0:c0 + cols].double()
            step = max(1, MERGE_CHUNK_BYTES // 8 // cols)
            for lo in range(r0, r0 + rows, step):
                hi = min(lo + step, r0 + rows)
                w = t[lo:hi, c0:c0 + cols]
                w.copy_(w.double() + m.scale * (b[lo:hi].double() @ a_block))
