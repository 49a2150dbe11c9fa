"""Copy canonical (Hugging Face) tensors into a rank's local tensors and back, by layout blocks.

Used to load a Hugging Face or GGUF checkpoint into this rank's Megatron shards (reading only the slices it
needs) and, in single-process tools, to assemble canonical tensors from local ones.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from megarl.models import fp8
from megarl.models.layout import LocalTensor, hf_layout, local_views
from megarl.models.spec import ModelSpec, SpecError


def fill_local_tensors(local: Mapping[str, LocalTensor], params: Mapping[str, torch.Tensor],
                       read_canonical: Callable[[str, tuple[slice, ...]], torch.Tensor]) -> None:
    """Write every block of every local tensor from canonical tensors, in place.

    Args:
        local: this rank's layout (local name -> :class:`LocalTensor`).
        params: local name -> the tensor to fill (e.g. ``dict(model.named_parameters())``); same shapes.
        read_canonical: ``(canonical name, box) -> tensor`` giving that box of the canonical tensor (a
            safetensors slice, a slice of an in-memory state dict, ...).

    A block-FP8 local tensor (:attr:`~megarl.models.layout.LocalTensor.scale`) is assembled in float32 and
    quantised (:func:`megarl.models.fp8.quantize_blocks`) into it and its scale tensor.

    Raises:
        SpecError: a local tensor missing from ``params`` or of another shape.
    """
    with torch.no_grad():
        for name, lt in local.items():
            if name not in params:
                raise SpecError(f"parameter {name!r} of the layout is missing from the model "
                                f"(model has {len(params)} parameters)")
            dst = params[name]
            if tuple(dst.shape) != lt.shape:
                raise SpecError(f"parameter {name!r} has shape {tuple(dst.shape)}, layout expects {lt.shape}")
            if lt.scale and dst.dtype not in (fp8.FP8_DTYPE, torch.uint8):
                raise SpecError(f"parameter {name!r} is block-FP8 in the layout but {dst.dtype} in the model")
            values = torch.zeros(lt.shape, dtype=torch.float32, device=dst.device) if lt.scale else dst
            for block in lt.blocks:
                src = read_canonical(block.name, block.src_box)
                values[block.dst_box].copy_(src)
            if lt.scale:
                q, scales = fp8.quantize_blocks(values)
                dst.copy_(q.view(dst.dtype))
                params[lt.scale].copy_(scales)


def state_dict_reader(state_dict: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]):
    """A ``read_canonical`` over an in-memory canonical state dict, checking names and shapes.

    Raises:
        SpecError: a canonical tensor missing from the checkpoint, or of another shape than the spec's.
    """
    def read(name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if name not in state_dict:
            raise SpecError(f"checkpoint has no tensor {name!r} (it has {len(state_dict)} tensors)")
        t = state_dict[name]
        if tuple(t.shape) != tuple(shapes[name]):
            raise SpecError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, the model config "
                            f"implies {tuple(shapes[name])}")
        return t[box]

    return read


def assemble_canonical(local: Mapping[str, LocalTensor], params: Mapping[str, torch.Tensor],
                       shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Build whole canonical tensors from one rank's local tensors that together cover all of them (a
    TP=1 x PP=1 Megatron model, an HF engine).

    Returns:
        canonical name -> tensor (dtype of the local tensor it came from).

    Raises:
        SpecError: a canonical tensor not fully covered by the local blocks.
    """
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for name, lt in local.items():
        src = params[name].detach()
        for block in lt.blocks:
            if block.name not in out:
                out[block.name] = torch.empty(shapes[block.name], dtype=src.dtype, device=src.device)
                covered[block.name] = 0
            elif covered[block.name] >= out[block.name].numel():
                continue  # a replica (tied embedding copy) of a tensor already complete
            out[block.name][block.src_box].copy_(src[block.dst_box])
            covered[block.name] += block.numel
    incomplete = [n for n, s in shapes.items() if covered.get(n, 0) != torch.Size(s).numel()]
    if incomplete:
        raise SpecError(f"local tensors do not cover canonical tensors {incomplete[:8]}")
    return out


def transformers_canonical(spec: ModelSpec, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The canonical (checkpoint-form) tensors of a transformers model of ``spec``: its parameters, with
    transformers 5's fused experts (``mlp.experts.gate_up_proj`` ``[experts, 2 * ffn, hidden]``,
    ``mlp.experts.down_proj`` ``[experts, hidden, ffn]``) split into one tensor per expert and projection.

    Args:
        params: the model's ``named_parameters()`` (any dtype; the outputs keep it).

    Returns:
        canonical name -> whole tensor, the shapes of ``spec.hf_tensor_shapes()``.

    Raises:
        SpecError: a parameter whose size differs from the spec's (the model is not one of ``spec``).
    """
    local = hf_layout(spec, [0], fused_experts=True).tensors(0)
    return assemble_canonical(local, local_views(params, local), spec.hf_tensor_shapes())
