// CUDA path of megarl._C.box_copy: one launch copies every box of a call.
//
// Each thread block copies one chunk of kCudaChunkBytes of one box (found by binary search over the boxes'
// first_chunk prefix sums), in units of the widest width (16/8/4/2/1 bytes) that the box's addresses, strides
// and row length allow. Threads walk the chunk kThreads units apart, kUnroll loads in flight before the stores,
// tracking (row, column) incrementally so the inner loop has no division.

#include <cuda_runtime.h>

#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "box_copy.h"

namespace megarl {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T>
__device__ __forceinline__ void copy_units(const BoxDesc& d, int64_t begin, int64_t end) {
  const int64_t row_units = d.row_bytes / static_cast<int64_t>(sizeof(T));
  int64_t u = begin + threadIdx.x;
  if (u >= end) return;
  int64_t row = u / row_units;
  int64_t col = u - row * row_units;
  const int64_t step_rows = kThreads / row_units;
  const int64_t step_cols = kThreads - step_rows * row_units;
  const char* src = reinterpret_cast<const char*>(d.src);
  char* dst = reinterpret_cast<char*>(d.dst);
  for (; u < end; u += static_cast<int64_t>(kThreads) * kUnroll) {
    T v[kUnroll];
    int64_t dst_off[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (u + k * kThreads < end) {
        v[k] = *reinterpret_cast<const T*>(src + row * d.src_stride + col * static_cast<int64_t>(sizeof(T)));
        dst_off[k] = row * d.dst_stride + col * static_cast<int64_t>(sizeof(T));
      }
      row += step_rows;
      col += step_cols;
      if (col >= row_units) {
        col -= row_units;
        ++row;
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (u + k * kThreads < end) *reinterpret_cast<T*>(dst + dst_off[k]) = v[k];
    }
  }
}

__global__ void __launch_bounds__(kThreads) box_copy_kernel(const BoxDesc* __restrict__ descs, int64_t n) {
  const int64_t chunk = blockIdx.x;
  int64_t lo = 0;
  int64_t hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (descs[mid].first_chunk <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const BoxDesc d = descs[lo];
  const int64_t begin = (chunk - d.first_chunk) * kCudaChunkBytes;
  const int64_t end = min(d.rows * d.row_bytes, begin + kCudaChunkBytes);
  switch (d.unit) {
    case 16: copy_units<uint4>(d, begin / 16, end / 16); break;
    case 8: copy_units<uint2>(d, begin / 8, end / 8); break;
    case 4: copy_units<uint32_t>(d, begin / 4, end / 4); break;
    case 2: copy_units<uint16_t>(d, begin / 2, end / 2); break;
    default: copy_units<uint8_t>(d, begin, end); break;
  }
}

}  // namespace

void launch_box_copy_cuda(const BoxDesc* descs, int64_t n, int64_t total_chunks, void* stream) {
  box_copy_kernel<<<static_cast<unsigned int>(total_chunks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      descs, n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace megarl
