// megarl._C.quantize_fp8_blocks: the reshard's pack for block-FP8 destinations (megarl/reshard/quantize.py).
//
// Each tile is quantised from its parts in two passes over them: the largest |value| (as float), then every value
// times 1 / scale converted to E4M3 (c10::Float8_e4m3fn, torch's own conversion: round to nearest even) into the
// destination, and the scale written once. Elements of a tile that no part covers are neither read nor written.
// A NaN in a tile leaves its scale as the largest finite |value| (the NaN itself stays NaN in the output).

#include "quantize_fp8.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#ifdef MEGARL_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "tensor_info.h"

namespace megarl {
namespace {
using detail::cat;
using detail::info_of;
using detail::locate;
using detail::TensorInfo;

constexpr const char* kOp = "quantize_fp8_blocks";

float load(const QuantPart& p, int64_t r, int64_t c) {
  const char* row = reinterpret_cast<const char*>(p.src + r * p.src_stride);
  switch (p.dtype) {
    case kQuantBFloat16: return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(row)[c]);
    case kQuantHalf: return static_cast<float>(reinterpret_cast<const c10::Half*>(row)[c]);
    default: return reinterpret_cast<const float*>(row)[c];
  }
}

void quantize_tile_cpu(const QuantTile& t, const QuantPart* parts) {
  float amax = 0.0f;
  for (int32_t k = 0; k < t.num_parts; ++k) {
    const QuantPart& p = parts[t.first_part + k];
    for (int64_t r = 0; r < p.rows; ++r)
      for (int64_t c = 0; c < p.cols; ++c) amax = std::fmax(amax, std::fabs(load(p, r, c)));
  }
  const float scale = std::fmax(amax, kAmaxFloor) * kInvE4m3Max;
  const float inv = 1.0f / scale;
  *reinterpret_cast<float*>(t.scale) = scale;
  for (int32_t k = 0; k < t.num_parts; ++k) {
    const QuantPart& p = parts[t.first_part + k];
    for (int64_t r = 0; r < p.rows; ++r) {
      uint8_t* out = reinterpret_cast<uint8_t*>(t.dst + (p.row_off + r) * t.dst_stride) + p.col_off;
      for (int64_t c = 0; c < p.cols; ++c) out[c] = c10::Float8_e4m3fn(load(p, r, c) * inv).x;
    }
  }
}

int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kQuantFloat;
    case at::kBFloat16: return kQuantBFloat16;
    case at::kHalf: return kQuantHalf;
    default: return -1;
  }
}

}  // namespace

int64_t quantize_fp8_blocks(const at::Tensor& tiles, const at::Tensor& parts, const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor* table : {&tiles, &parts}) {
    const int64_t width = table == &tiles ? 9 : 7;
    TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == at::kLong && table->dim() == 2 &&
                    table->size(1) == width && table->is_contiguous(),
                cat(kOp, ": ", table == &tiles ? "tiles" : "parts", " must be a contiguous CPU int64 tensor [n, ",
                    width, "], got ", table->scalar_type(), " ", table->sizes(), " on ", table->device()));
  }
  const int64_t n = tiles.size(0);
  const int64_t m = parts.size(0);
  if (n == 0) return 0;
  TORCH_CHECK(!tensors.empty(), cat(kOp, ": no tensors"));
  const int64_t count = static_cast<int64_t>(tensors.size());
  const int64_t* tp = tiles.data_ptr<int64_t>();
  const at::Device device = tensors[tp[0] >= 0 && tp[0] < count ? tp[0] : 0].device();
  std::vector<TensorInfo> info;
  info.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) info.push_back(info_of(tensors[i], i, device, kOp));
  auto tensor = [&](int64_t index, const char* what, int64_t i) -> const TensorInfo& {
    TORCH_CHECK(index >= 0 && index < count, cat(kOp, ": ", what, " of tile ", i, " names tensor ", index, " of ", count));
    return info[index];
  };

  std::vector<QuantPart> part_descs(static_cast<size_t>(m));
  const int64_t* pp = parts.data_ptr<int64_t>();
  std::vector<QuantTile> tile_descs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i, tp += 9) {
    const TensorInfo& dst = tensor(tp[0], "destination", i);
    const TensorInfo& scale = tensor(tp[5], "scale", i);
    TORCH_CHECK(dst.dtype == at::kFloat8_e4m3fn || dst.dtype == at::kByte,
                cat(kOp, ": the destination of tile ", i, " is ", dst.dtype, " (float8_e4m3fn or uint8 expected)"));
    TORCH_CHECK(scale.dtype == at::kFloat, cat(kOp, ": the scale of tile ", i, " is ", scale.dtype, " (float32 expected)"));
    const int64_t rows = tp[3];
    const int64_t cols = tp[4];
    TORCH_CHECK(rows > 0 && cols > 0, cat(kOp, ": tile ", i, " has ", rows, " x ", cols, " elements"));
    QuantTile& t = tile_descs[i];
    locate(dst, tp[1], tp[2], rows, cols, i, &t.dst, &t.dst_stride, kOp);
    int64_t unused = 0;
    locate(scale, tp[6], tp[7], 1, 1, i, &t.scale, &unused, kOp);
    const int64_t first = tp[8];
    const int64_t last = i + 1 < n ? tp[9 + 8] : m;
    TORCH_CHECK(0 <= first && first <= last && last <= m,
                cat(kOp, ": tile ", i, " has parts [", first, ", ", last, ") of ", m));
    t.first_part = static_cast<int32_t>(first);
    t.num_parts = static_cast<int32_t>(last - first);
    for (int64_t k = first; k < last; ++k) {
      const int64_t* q = pp + 7 * k;
      const TensorInfo& src = tensor(q[0], "a part", i);
      QuantPart& p = part_descs[k];
      p.dtype = dtype_code(src.dtype);
      TORCH_CHECK(p.dtype >= 0, cat(kOp, ": part ", k, " of tile ", i, " reads a ", src.dtype,
                                    " tensor (float32, bfloat16 or float16 expected)"));
      TORCH_CHECK(q[3] > 0 && q[4] > 0 && q[5] >= 0 && q[6] >= 0 && q[5] + q[3] <= rows && q[6] + q[4] <= cols,
                  cat(kOp, ": part ", k, " (", q[3], " x ", q[4], " at ", q[5], ", ", q[6], ") lies outside its tile ", i,
                      " of ", rows, " x ", cols));
      locate(src, q[1], q[2], q[3], q[4], k, &p.src, &p.src_stride, kOp);
      p.rows = static_cast<int32_t>(q[3]);
      p.cols = static_cast<int32_t>(q[4]);
      p.row_off = static_cast<int32_t>(q[5]);
      p.col_off = static_cast<int32_t>(q[6]);
      p.pad = 0;
    }
  }
  const int64_t bytes = n * static_cast<int64_t>(sizeof(QuantTile)) + m * static_cast<int64_t>(sizeof(QuantPart));
  if (device.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    TORCH_CHECK(n < (int64_t{1} << 31), cat(kOp, ": ", n, " tiles exceed one launch's grid"));
    const c10::cuda::CUDAGuard guard(device);
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    auto* h = static_cast<char*>(host.data_ptr());
    std::memcpy(h, tile_descs.data(), static_cast<size_t>(n) * sizeof(QuantTile));
    std::memcpy(h + n * sizeof(QuantTile), part_descs.data(), static_cast<size_t>(m) * sizeof(QuantPart));
    // from pinned memory: asynchronous, and the host block is not reused before the copy has run
    const at::Tensor on_device = host.to(device, /*non_blocking=*/true);
    const char* d = static_cast<const char*>(on_device.data_ptr());
    launch_quantize_fp8_cuda(reinterpret_cast<const QuantTile*>(d), n,
                             reinterpret_cast<const QuantPart*>(d + n * sizeof(QuantTile)),
                             at::cuda::getCurrentCUDAStream().stream());
    return 2 * bytes;
#else
    TORCH_CHECK(false, cat(kOp, ": megarl._C was built without CUDA; rebuild it where nvcc and a GPU exist"));
#endif
  }
  TORCH_CHECK(device.is_cpu(), cat(kOp, ": unsupported device ", device));
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_tile_cpu(tile_descs[i], part_descs.data());
  });
  return bytes;
}

}  // namespace megarl
