"""Block-wise FP8 weights: the format vLLM 0.24.0 serves with ``quantization: fp8`` and ``weight_block_size:
[128, 128]`` (the DeepSeek-V3 layout), and its plain torch implementation.

A weight ``W`` ``[rows, cols]`` is cut into tiles of :data:`BLOCK` x :data:`BLOCK` elements (the last tile of a
dim is cut at the edge). Each tile ``T`` is stored as E4M3 (``torch.float8_e4m3fn``, largest finite value
:data:`E4M3_MAX` = 448) with one float32 scale, the tile's dequantisation multiplier
(vLLM's ``weight_scale_inv``, ``[ceil(rows / 128), ceil(cols / 128)]``)::

    amax  = max(max |T|, 1e-4)              (float32; 1e-4 keeps an all-zero tile finite)
    scale = amax * fl(1 / 448)              (float32: the reciprocal rounded once, then one product)
    q     = e4m3(float32(T) * (1 / scale))  (round to nearest even; |value| <= 448)
    T ~= float32(q) * scale

which is, operation for operation, ``vllm.utils.deep_gemm.per_block_cast_to_fp8(W, [128, 128],
use_ue8m0=False)`` run eagerly on the GPU (read in vLLM 0.24.0; the function vLLM's online ``fp8_per_block``
quantisation calls). Its ``amax / 448.0`` is, on CUDA, a multiply by the float32 reciprocal: torch divides a CUDA
tensor by a Python scalar that way (ATen's ``div_true_kernel_cuda``), while on the CPU it divides; on the H200
(2026-12-03) IEEE division gave other scales in 106 of 192 tiles of a 2048 x 1536 weight, so the format is the
GPU's on every device. Compiled by torch.compile, as vLLM ships it, Inductor lowers its float32 divisions to
Triton's approximate ``div.full.f32`` unless ``TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1`` (torch 2.11's
``torch._inductor.config.eager_numerics.division_rounding``), so that form can differ from this one in the last
bit of a scale: the GPU test reports both (``tests/test_gpu_fp8.py``).

After loading, vLLM 0.24 on Hopper keeps a block-FP8 linear layer's ``weight`` (E4M3 ``[rows, cols]``, row-major)
and ``weight_scale_inv`` (float32 ``[ceil(rows / 128), ceil(cols / 128)]``) as they were created, provided
DeepGEMM is off (``VLLM_USE_DEEP_GEMM=0``, set by :mod:`megarl.rollout.vllm_engine`): the CUTLASS block kernel it
then picks (``CutlassFp8BlockScaledMMKernel``) only re-registers both tensors
(``process_fp8_weight_block_strategy``: padding only on ROCm), and reads ``weight.T`` / ``weight_scale_inv.T`` as
views at run time, so writing both in place is a weight update. DeepGEMM (vLLM's first choice on SM90, bundled
in the wheel) would requantise every weight to power-of-two (UE8M0) scales and re-lay out the scales at load
(``requant_weight_ue8m0_inplace``, ``transform_sf_into_required_layout``): other bytes than these.

The reshard quantises while it packs (``megarl._C.quantize_fp8_blocks``, :mod:`megarl.reshard.quantize`); this
module is the format's reference and the fallback where the extension is not built.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128  # tile side, elements (vLLM's weight_block_size [128, 128])
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INV_E4M3_MAX = 1.0 / E4M3_MAX  # a float32 multiplier once cast (its float32 rounding is that of 1.0f / 448.0f)
AMAX_FLOOR = 1e-4  # per_block_cast_to_fp8's clamp of the tile's amax
FP8_DTYPE = torch.float8_e4m3fn


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scale tensor of a ``[rows, cols]`` weight: ``(ceil(rows / 128), ceil(cols / 128))``."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


def quantize_tile(tile: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile (at most 128 x 128, any float dtype) as ``(E4M3 [same shape], float32 scalar scale)`` (module
    docstring)."""
    x = tile.float()
    amax = x.abs().amax().clamp(min=AMAX_FLOOR)
    scale = amax * INV_E4M3_MAX  # not / E4M3_MAX: the CUDA form (module docstring)
    return (x * scale.reciprocal()).to(FP8_DTYPE), scale


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight tile by tile.

    Args:
        weight: ``[rows, cols]``, bfloat16 / float16 / float32.

    Returns:
        ``(E4M3 [rows, cols], float32 scales [ceil(rows / 128), ceil(cols / 128)])``.

    Raises:
        ValueError: not a 2-D tensor.
    """
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantises 2-D weights, got shape {tuple(weight.shape)}")
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty(scale_shape(tuple(weight.shape)), dtype=torch.float32, device=weight.device)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            box = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            q[box], scales[i, j] = quantize_tile(weight[box])
    return q, scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``float32(q) * scale`` of each tile: the weight the engine computes with, float32 ``[rows, cols]``."""
    full = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:q.shape[0], :q.shape[1]]
    return q.float() * full
