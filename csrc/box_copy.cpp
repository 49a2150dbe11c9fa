// megarl._C: batched box copies for the reshard (pack, unpack and same-rank region copies).
//
// box_copy(boxes, tensors) copies every box of `boxes`, an int64 CPU tensor [n, 8] of
//   (src tensor index, src row, src col, dst tensor index, dst row, dst col, rows, cols)
// counted in elements of the indexed tensors of the list `tensors`, all on one device. A box in a 2-D tensor is
// rows [row, row + rows) x columns [col, col + cols); in a 1-D tensor (a staging buffer) it is rows * cols
// elements packed from element `col` on (row must be 0). Tensors need a contiguous last dim. Boxes are checked
// against their tensors' bounds. Pairs of different dtypes are not copied: their indices are returned for the
// caller's casting copy. One CUDA kernel launch on the current stream copies every box, or at::parallel_for
// over fixed-size chunks with memcpy on CPU. Destinations must not overlap.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#ifdef MEGARL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "box_copy.h"
#include "quantize_fp8.h"
#include "tensor_info.h"

namespace megarl {
namespace {
using detail::cat;
using detail::info_of;
using detail::locate;
using detail::TensorInfo;

int64_t widest_unit(const BoxDesc& d) {
  uint64_t bits = static_cast<uint64_t>(d.src) | static_cast<uint64_t>(d.dst) | static_cast<uint64_t>(d.row_bytes);
  if (d.rows > 1) bits |= static_cast<uint64_t>(d.src_stride) | static_cast<uint64_t>(d.dst_stride);
  const uint64_t lowest = bits & (~bits + 1);
  return static_cast<int64_t>(std::min<uint64_t>(lowest, 16));
}

// Copies bytes [c * chunk, (c + 1) * chunk) of box `d`, its bytes taken row-major.
void copy_chunk_cpu(const BoxDesc& d, int64_t c, int64_t chunk) {
  int64_t b = c * chunk;
  const int64_t e = std::min(d.rows * d.row_bytes, b + chunk);
  int64_t row = b / d.row_bytes;
  int64_t col = b - row * d.row_bytes;
  while (b < e) {
    const int64_t n = std::min(d.row_bytes - col, e - b);
    std::memcpy(reinterpret_cast<char*>(d.dst + row * d.dst_stride + col),
                reinterpret_cast<const char*>(d.src + row * d.src_stride + col), static_cast<size_t>(n));
    b += n;
    ++row;
    col = 0;
  }
}

// Returns the bookkeeping bytes allocated (descriptor tables, host and device) and the indices of the boxes
// left to the caller because their dtypes differ.
std::tuple<int64_t, at::Tensor> box_copy(const at::Tensor& boxes, const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(boxes.device().is_cpu() && boxes.scalar_type() == at::kLong && boxes.dim() == 2 &&
                  boxes.size(1) == 8 && boxes.is_contiguous(),
              cat("box_copy: boxes must be a contiguous CPU int64 tensor [n, 8], got ", boxes.scalar_type(), " ",
                  boxes.sizes(), " on ", boxes.device()));
  const int64_t n = boxes.size(0);
  std::vector<int64_t> skipped;
  if (n == 0) return {0, at::empty({0}, at::kLong)};
  TORCH_CHECK(!tensors.empty(), "box_copy: no tensors");
  const int64_t* p = boxes.data_ptr<int64_t>();
  const int64_t count = static_cast<int64_t>(tensors.size());
  const at::Device device = tensors[p[3] >= 0 && p[3] < count ? p[3] : 0].device();
  std::vector<TensorInfo> info;
  info.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) info.push_back(info_of(tensors[i], i, device));
  const bool cuda = device.is_cuda();
  const int64_t chunk = cuda ? kCudaChunkBytes : kCpuChunkBytes;
  std::vector<BoxDesc> descs;
  descs.reserve(n);
  int64_t chunks = 0;
  for (int64_t i = 0; i < n; ++i, p += 8) {
    TORCH_CHECK(p[0] >= 0 && p[0] < count && p[3] >= 0 && p[3] < count,
                cat("box_copy: box ", i, " names tensors ", p[0], " and ", p[3], " of ", count));
    const TensorInfo& s = info[p[0]];
    const TensorInfo& d = info[p[3]];
    const int64_t rows = p[6];
    const int64_t cols = p[7];
    TORCH_CHECK(rows >= 0 && cols >= 0, cat("box_copy: box ", i, " has ", rows, " x ", cols, " elements"));
    if (rows == 0 || cols == 0) continue;
    if (s.dtype != d.dtype) {
      skipped.push_back(i);
      continue;
    }
    BoxDesc desc{0, 0, 0, 0, rows, cols * s.elem, 0, 0};
    locate(s, p[1], p[2], rows, cols, i, &desc.src, &desc.src_stride);
    locate(d, p[4], p[5], rows, cols, i, &desc.dst, &desc.dst_stride);
    if (desc.src_stride == desc.row_bytes && desc.dst_stride == desc.row_bytes) {  // contiguous on both sides
      desc.row_bytes *= desc.rows;
      desc.rows = 1;
    }
    if (desc.rows == 1) desc.src_stride = desc.dst_stride = desc.row_bytes;
    desc.unit = widest_unit(desc);
    desc.first_chunk = chunks;
    chunks += (desc.rows * desc.row_bytes + chunk - 1) / chunk;
    descs.push_back(desc);
  }
  at::Tensor left = at::tensor(skipped, at::kLong);
  if (descs.empty()) return {0, left};
  const int64_t m = static_cast<int64_t>(descs.size());
  const int64_t bytes = m * static_cast<int64_t>(sizeof(BoxDesc));
  if (cuda) {
#ifdef MEGARL_WITH_CUDA
    TORCH_CHECK(chunks < (int64_t{1} << 31), cat("box_copy: ", chunks, " chunks exceed one launch's grid"));
    const c10::cuda::CUDAGuard guard(device);
    at::Tensor host = at::empty({m * 8}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), descs.data(), static_cast<size_t>(bytes));
    // from pinned memory: asynchronous, and the host block is not reused before the copy has run
    const at::Tensor on_device = host.to(device, /*non_blocking=*/true);
    launch_box_copy_cuda(reinterpret_cast<const BoxDesc*>(on_device.data_ptr()), m, chunks,
                         at::cuda::getCurrentCUDAStream().stream());
    return {2 * bytes, left};
#else
    TORCH_CHECK(false, "box_copy: megarl._C was built without CUDA; rebuild it where nvcc and a GPU exist");
#endif
  }
  TORCH_CHECK(device.is_cpu(), cat("box_copy: unsupported device ", device));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    auto it = std::upper_bound(descs.begin(), descs.end(), begin,
                               [](int64_t c, const BoxDesc& d) { return c < d.first_chunk; });
    --it;
    for (int64_t c = begin; c < end; ++c) {
      while (std::next(it) != descs.end() && std::next(it)->first_chunk <= c) ++it;
      copy_chunk_cpu(*it, c - it->first_chunk, chunk);
    }
  });
  return {bytes, left};
}

}  // namespace
}  // namespace megarl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megarl reshard kernels: batched box copies and block-FP8 quantisation (CPU and CUDA)";
  m.def("box_copy", &megarl::box_copy, pybind11::arg("boxes"), pybind11::arg("tensors"),
        "Copy every box of an int64 CPU tensor [n, 8] (src tensor index, src row, src col, dst tensor index, dst "
        "row, dst col, rows, cols), in elements of the listed tensors (2-D: a box; 1-D: rows * cols packed from "
        "col), all on one device: one CUDA launch on the current stream, or at::parallel_for on CPU. Boxes are "
        "checked against their tensors. Returns (bookkeeping bytes, int64 indices of the boxes skipped because "
        "their dtypes differ).");
  m.def("quantize_fp8_blocks", &megarl::quantize_fp8_blocks, pybind11::arg("tiles"), pybind11::arg("parts"),
        pybind11::arg("tensors"),
        "Quantise tiles to block FP8 (E4M3 values, one float32 scale a tile: amax x fl(1 / 448), the format of "
        "megarl.models.fp8): int64 CPU tables tiles [n, 9] (dst tensor index, dst row, dst col, rows, cols, scale "
        "tensor index, scale row, scale col, first part) and parts [m, 7] (src tensor index, src row, src col, "
        "rows, cols, row offset in the tile, col offset in the tile), tile i made of parts [tiles[i, 8], "
        "tiles[i + 1, 8]) (the last up to m), in elements of the listed tensors (2-D boxes, or 1-D packed as in "
        "box_copy), all on one device: one CUDA launch on the current stream, or at::parallel_for on CPU. "
        "Sources float32 / bfloat16 / float16, destinations float8_e4m3fn or uint8, scales float32. Returns "
        "the bookkeeping bytes.");
  m.attr("cuda") = pybind11::bool_(
#ifdef MEGARL_WITH_CUDA
      true
#else
      false
#endif
  );
}
