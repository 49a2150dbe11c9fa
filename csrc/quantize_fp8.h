// Block-FP8 quantisation for the reshard (megarl._C.quantize_fp8_blocks): descriptors shared by the CPU and CUDA
// paths. The format (E4M3 values, one float32 scale a tile: max(amax, 1e-4) x fl(1 / 448), values times 1 / scale rounded
// to nearest even) is megarl.models.fp8's.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace megarl {

// One tile: its destination (E4M3 bytes, rows `dst_stride` bytes apart) and the address of its float32 scale;
// its values come from parts [first_part, first_part + num_parts) of the call's part list.
struct QuantTile {
  int64_t dst;
  int64_t dst_stride;
  int64_t scale;
  int32_t first_part;
  int32_t num_parts;
};
static_assert(sizeof(QuantTile) == 32, "QuantTile is 32 bytes");

// One box of source elements (rows `src_stride` bytes apart, `dtype` a kQuant* code) placed at (row_off, col_off)
// of its tile.
struct QuantPart {
  int64_t src;
  int64_t src_stride;
  int32_t rows;
  int32_t cols;
  int32_t row_off;
  int32_t col_off;
  int32_t dtype;
  int32_t pad;
};
static_assert(sizeof(QuantPart) == 40, "QuantPart is 40 bytes");

constexpr int32_t kQuantFloat = 0;
constexpr int32_t kQuantBFloat16 = 1;
constexpr int32_t kQuantHalf = 2;
constexpr float kE4m3Max = 448.0f;
// The scale is amax times this float32 reciprocal, not amax / 448: torch on CUDA divides a tensor by a Python
// scalar as a multiply by the scalar's float32 reciprocal (ATen's div_true_kernel_cuda), and that is how vLLM's
// per_block_cast_to_fp8 forms amax / 448.0 on the GPU (IEEE division differed in 106 of 192 scales, H200).
constexpr float kInvE4m3Max = 1.0f / kE4m3Max;
constexpr float kAmaxFloor = 1e-4f;

// Quantise every tile of `tiles` (int64 [n, 9]) from its parts (`parts`, int64 [m, 7]) in the listed tensors;
// returns the bookkeeping bytes (descriptor tables, host and device). See the binding's docstring (box_copy.cpp).
int64_t quantize_fp8_blocks(const at::Tensor& tiles, const at::Tensor& parts, const std::vector<at::Tensor>& tensors);

#ifdef MEGARL_WITH_CUDA
// Enqueue the quantisation of `n` device-resident tiles (one thread block each) on `stream`.
void launch_quantize_fp8_cuda(const QuantTile* tiles, int64_t n, const QuantPart* parts, void* stream);
#endif

}  // namespace megarl
