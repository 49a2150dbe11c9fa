// CUDA path of megarl._C.quantize_fp8_blocks: one thread block quantises one tile.
//
// Pass 1: the threads stride over every part's elements (consecutive threads, consecutive columns) for the largest
// |value|, reduced over the block (warp shuffles, then one value a warp in shared memory). Pass 2: the same elements
// again (from L2: a 128 x 128 bf16 tile is 32 KiB), times 1 / scale, to E4M3 with torch's conversion
// (c10::Float8_e4m3fn), one byte each into the destination; thread 0 writes the scale (amax x fl(1 / 448), quantize_fp8.h). IEEE division (nvcc's
// default -prec-div=true; no fast math), as torch's eager ops.

#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "quantize_fp8.h"

namespace megarl {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const QuantPart& p, int64_t r, int64_t c) {
  const char* row = reinterpret_cast<const char*>(p.src + r * p.src_stride);
  switch (p.dtype) {
    case kQuantBFloat16: return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(row)[c]);
    case kQuantHalf: return static_cast<float>(reinterpret_cast<const c10::Half*>(row)[c]);
    default: return reinterpret_cast<const float*>(row)[c];
  }
}

__global__ void __launch_bounds__(kThreads) quantize_kernel(const QuantTile* __restrict__ tiles,
                                                           const QuantPart* __restrict__ parts) {
  const QuantTile t = tiles[blockIdx.x];
  __shared__ float warp_max[kThreads / 32];
  __shared__ float inv_shared;
  float amax = 0.0f;
  for (int32_t k = 0; k < t.num_parts; ++k) {
    const QuantPart p = parts[t.first_part + k];
    const int64_t n = static_cast<int64_t>(p.rows) * p.cols;
    for (int64_t e = threadIdx.x; e < n; e += kThreads) {
      const int64_t r = e / p.cols;
      amax = fmaxf(amax, fabsf(load(p, r, e - r * p.cols)));
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_max[0];
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
    const float scale = fmaxf(m, kAmaxFloor) * kInvE4m3Max;
    *reinterpret_cast<float*>(t.scale) = scale;
    inv_shared = 1.0f / scale;
  }
  __syncthreads();
  const float inv = inv_shared;
  for (int32_t k = 0; k < t.num_parts; ++k) {
    const QuantPart p = parts[t.first_part + k];
    const int64_t n = static_cast<int64_t>(p.rows) * p.cols;
    for (int64_t e = threadIdx.x; e < n; e += kThreads) {
      const int64_t r = e / p.cols;
      const int64_t c = e - r * p.cols;
      uint8_t* out = reinterpret_cast<uint8_t*>(t.dst + (p.row_off + r) * t.dst_stride) + p.col_off + c;
      *out = c10::Float8_e4m3fn(load(p, r, c) * inv).x;
    }
  }
}

}  // namespace

void launch_quantize_fp8_cuda(const QuantTile* tiles, int64_t n, const QuantPart* parts, void* stream) {
  quantize_kernel<<<static_cast<unsigned int>(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(tiles, parts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace megarl
