"""Copy canonical (Hugging Face) tensors into a rank's local tensors and back, by layout blocks.

Used to load a Hugging Face or GGUF checkpoint into this rank's Megatron shards (reading only the slices it
needs) and, in single-process tools, to assemble canonical tensors from local ones.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Mapping

import torch

from megarl.models import fp8, gpt_oss
from megarl.models.layout import VALUE_HEAD, LocalTensor, canonical_shapes, hf_layout, local_views
from megarl.models.spec import FAMILIES, ModelSpec, SpecError


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


PRESET_INIT_STD = 0.02  # megatron-core's init_method_std
_M32 = 0xFFFFFFFF
_CHUNK = 1 << 22  # elements hashed at a time (the int64 temporaries of 4M elements: 32 MB each)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (avalanche in every bit) of int64 tensors holding values in
    ``[0, 2**32)``; every product stays below ``2**59``, so the int64 arithmetic is exact on any device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def preset_std(spec: ModelSpec, name: str) -> float | None:
    """How megatron-core initialises canonical tensor ``name`` of ``spec``: the std of its zero-mean normal
    (``init_method_std`` 0.02; the output projections ``o_proj`` / ``down_proj`` of attention, MLP and experts
    0.02 / sqrt(2 * num_layers), megatron's ``scaled_init_method_normal``), 0.0 for zeros (biases, the critic's
    value head) or None for ones (RMSNorm weights)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias") or name == VALUE_HEAD:
        return 0.0
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return PRESET_INIT_STD / math.sqrt(2.0 * spec.num_layers)
    return PRESET_INIT_STD


def preset_reader(spec: ModelSpec, role: str, seed: int,
                  device: torch.device | str | None = None) -> Callable[[str, tuple[slice, ...]], torch.Tensor]:
    """A ``read_canonical`` (:func:`fill_local_tensors`) of the random weights of a ``preset:NAME`` model: the
    same canonical (Hugging Face layout) tensors at every layout, so TP=1, TP=2 and PP=2 hold one model and a run
    resumed at another layout keeps its reference model.

    Element ``i`` (row-major flat index) of canonical tensor ``name`` is a function of ``(seed, name, i)`` alone:
    two 32-bit hashes of ``i`` keyed by the CRC32 of ``"{seed}:{name}"`` give two uniforms, a Box-Muller transform
    (float64) a standard normal, scaled by :func:`preset_std` (megatron's init). A box is computed directly,
    without drawing the whole tensor; the integer part is exact on any device, the float64 transform agrees across
    devices to its last bits, far below the float32 / bf16 rounding of the result.

    Args:
        spec: the preset's shape. role: "actor" or "critic" (which canonical tensors exist:
            :func:`~megarl.models.layout.canonical_shapes`). seed: the run's seed (``run.seed``).
        device: where to compute the boxes (the model's device; None = CPU).

    Returns:
        ``(name, box) -> float32 tensor`` of the box's shape, on ``device``.

    Raises:
        SpecError (from the reader): a name the role's canonical tensors do not have, a tensor of 2**31 elements
            or more, or a box that is not one slice per dim.
    """
    shapes = canonical_shapes(spec, role)

    def read(name: str, box: tuple[slice, ...]) -> torch.Tensor:
        if name not in shapes:
            raise SpecError(f"preset model {spec} ({role}) has no canonical tensor {name!r}")
        shape = shapes[name]
        if len(box) != len(shape) or not all(isinstance(b, slice) for b in box):
            raise SpecError(f"box {box} of {name!r} must be one slice per dim of {shape}")
        ranges = [range(*b.indices(n)) for b, n in zip(box, shape)]
        std = preset_std(spec, name)
        out_shape = tuple(len(r) for r in ranges)
        if std is None or std == 0.0:
            return torch.full(out_shape, 1.0 if std is None else 0.0, device=device)
        if math.prod(shape) >= 1 << 31:
            raise SpecError(f"canonical tensor {name!r} {shape} has 2**31 elements or more: too large for the "
                            "preset initialisation's 32-bit element hash")
        key = zlib.crc32(f"{seed}:{name}".encode())
        key2 = zlib.crc32(f"{name}:{seed}".encode())
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        out = torch.empty(out_shape, dtype=torch.float32, device=device)
        rows = ranges[0]
        step = max(1, _CHUNK // max(1, math.prod(out_shape[1:])))
        for lo in range(0, len(rows), step):
            idx = torch.arange(rows.start + lo * rows.step, rows.start + min(lo + step, len(rows)) * rows.step,
                               rows.step, dtype=torch.int64, device=device) * strides[0]
            for d in range(1, len(shape)):
                r = torch.arange(ranges[d].start, ranges[d].stop, ranges[d].step, dtype=torch.int64, device=device)
                idx = idx.unsqueeze(-1) + r * strides[d]
            u1 = (_mix32(_mix32((2 * idx) ^ key) ^ key2).double() + 0.5) / 2.0 ** 32
            u2 = (_mix32(_mix32((2 * idx + 1) ^ key) ^ key2).double() + 0.5) / 2.0 ** 32
            z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
            out[lo:lo + step] = (z * std).float()
        return out

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
    if FAMILIES[spec.family].gpt_oss:  # transformers holds the checkpoint's fused experts
        return gpt_oss.checkpoint_to_canonical(spec, params)
    local = hf_layout(spec, [0], fused_experts=True).tensors(0)
    return assemble_canonical(local, local_views(params, local), spec.hf_tensor_shapes())
