// Batched box copies for the reshard (megarl._C.box_copy): shared descriptor format of the CPU and CUDA paths.
#pragma once

#include <cstdint>

namespace megarl {

// One normalised box copy: `rows` rows of `row_bytes` bytes, from `src` (rows `src_stride` bytes apart) to
// `dst` (rows `dst_stride` bytes apart). `unit` is the widest of 16/8/4/2/1 bytes that divides every address,
// stride and the row length (the vector width the CUDA kernel may use). The box's bytes, taken row-major, are
// cut into chunks of a fixed size; `first_chunk` is the index of the box's first chunk among all chunks of the
// call (a prefix sum), so chunk c belongs to the last box whose first_chunk <= c.
struct BoxDesc {
  int64_t src;
  int64_t src_stride;
  int64_t dst;
  int64_t dst_stride;
  int64_t rows;
  int64_t row_bytes;
  int64_t unit;
  int64_t first_chunk;
};
static_assert(sizeof(BoxDesc) == 64, "BoxDesc is 8 int64");

constexpr int64_t kCudaChunkBytes = 64 * 1024;  // bytes one CUDA thread block copies
constexpr int64_t kCpuChunkBytes = 1024 * 1024;  // bytes one at::parallel_for task copies

#ifdef MEGARL_WITH_CUDA
// Enqueue the copy of `total_chunks` chunks described by `n` device-resident descriptors on `stream`.
void launch_box_copy_cuda(const BoxDesc* descs, int64_t n, int64_t total_chunks, void* stream);
#endif

}  // namespace megarl
