// Shared by the megarl._C ops (box_copy.cpp, quantize_fp8.cpp): error text without ostream formatting, what an op
// reads of each tensor once per call, and the bounds-checked address of a box in a tensor.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace megarl {
namespace detail {

// Error messages are built with std::to_string, not with TORCH_CHECK's ostream formatting of several
// arguments: on the GPU machine's toolchain (g++ 13.3 in /opt/gcc, torch 2.11+cu130) an extension formatting an
// integer through std::ostringstream in a failing TORCH_CHECK crashed the process (seen 2026-11-29).
inline std::string text(const char* s) { return s; }
inline std::string text(c10::ScalarType t) { return c10::toString(t); }
inline std::string text(const c10::Device& d) { return d.str(); }
inline std::string text(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
inline std::string text(T v) {
  return std::to_string(v);
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  ((out += text(args)), ...);
  return out;
}

// What an op reads of one tensor, once per call.
struct TensorInfo {
  char* data;
  int64_t elem;
  int64_t dim;
  int64_t size0;
  int64_t size1;
  int64_t stride0;
  at::ScalarType dtype;
};

// `op` names the calling op in the message.
inline TensorInfo info_of(const at::Tensor& t, size_t i, const at::Device& device, const char* op = "box_copy") {
  TORCH_CHECK(t.device() == device, cat(op, ": tensor ", i, " is on ", t.device(), ", the others on ", device));
  TORCH_CHECK(t.dim() == 1 || t.dim() == 2, cat(op, ": tensor ", i, " has ", t.dim(), " dims (1 or 2 expected)"));
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1,
              cat(op, ": tensor ", i, " has last-dim stride ", t.stride(-1)));
  return {static_cast<char*>(t.data_ptr()), static_cast<int64_t>(t.element_size()), t.dim(), t.size(0),
          t.dim() == 2 ? t.size(1) : 1, t.dim() == 2 ? t.stride(0) : 0, t.scalar_type()};
}

// Byte address and row stride of one side of box `i`, after checking that the box lies inside its tensor.
// `op` names the calling op in the message.
inline void locate(const TensorInfo& t, int64_t row, int64_t col, int64_t rows, int64_t cols, int64_t i,
                   int64_t* address, int64_t* stride, const char* op = "box_copy") {
  if (t.dim == 2) {
    TORCH_CHECK(row >= 0 && col >= 0 && row + rows <= t.size0 && col + cols <= t.size1,
                cat(op, ": box ", i, " [", row, ", ", row + rows, ") x [", col, ", ", col + cols,
                    ") lies outside its tensor of ", t.size0, " x ", t.size1));
    *address = reinterpret_cast<int64_t>(t.data) + (row * t.stride0 + col) * t.elem;
    *stride = t.stride0 * t.elem;
  } else {
    TORCH_CHECK(row == 0 && col >= 0 && col + rows * cols <= t.size0,
                cat(op, ": packed box ", i, " of ", rows, " x ", cols, " at ", col, " lies outside its buffer of ",
                    t.size0));
    *address = reinterpret_cast<int64_t>(t.data) + col * t.elem;
    *stride = cols * t.elem;
  }
}

}  // namespace detail
}  // namespace megarl
