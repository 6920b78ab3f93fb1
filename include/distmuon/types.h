// Basic value types shared by every layer: element types, tensor views and the batched
// matrix descriptors that the Backend interface works on.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace distmuon {

enum class DType : int { kF64 = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

// Bytes per element of `t`.
size_t dtype_size(DType t);
// "f64", "f32", "bf16", "f16".
const char* dtype_name(DType t);
// Parses the names above (also "float32", "bfloat16", "float16", "float64"); throws on others.
DType parse_dtype(const std::string& s);

// Products and sums of sizes, checked: the result, or an Error that names `what` when a size is
// negative or the result does not fit in int64 (a wrapped size would allocate the wrong amount
// or index out of bounds). checked_numel is the element count of a shape (1 for []).
int64_t checked_mul(int64_t a, int64_t b, const std::string& what);
int64_t checked_add(int64_t a, int64_t b, const std::string& what);
int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what);
// Bytes of `numel` elements of `t` (checked as above).
int64_t checked_bytes(int64_t numel, DType t, const std::string& what);

enum class DeviceKind : int { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCPU;
  int index = 0;
  bool operator==(const Device&) const = default;
};

// A non-owning view of an n-dimensional strided tensor (strides in elements, row-major sense).
struct TensorView {
  void* data = nullptr;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DType dtype = DType::kF32;
  Device device;

  int64_t numel() const;
  bool is_contiguous() const;
  // A contiguous view over `data` with the given shape.
  static TensorView contiguous(void* data, std::vector<int64_t> shape, DType dtype,
                               Device device = {});
};

// One row-major matrix in backend memory: element (i, j) is at data[i * ld + j].
struct MatRef {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0, ld = 0;

  static MatRef of(void* data, DType dtype, int64_t rows, int64_t cols) {
    return MatRef{data, dtype, rows, cols, cols};
  }
  size_t bytes() const { return static_cast<size_t>(rows * cols) * dtype_size(dtype); }
};

// `count` same-shape row-major matrices, matrix b starting `stride` elements after matrix b-1.
struct BatchRef {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t count = 0, rows = 0, cols = 0, ld = 0, stride = 0;

  // A densely packed batch (ld = cols, stride = rows * cols).
  static BatchRef packed(void* data, DType dtype, int64_t count, int64_t rows, int64_t cols) {
    return BatchRef{data, dtype, count, rows, cols, cols, rows * cols};
  }
  MatRef matrix(int64_t b) const {
    auto* p = static_cast<char*>(data) + static_cast<size_t>(b * stride) * dtype_size(dtype);
    return MatRef{p, dtype, rows, cols, ld};
  }
  // Matrices [first, first + n) of this batch.
  BatchRef slice(int64_t first, int64_t n) const {
    BatchRef r = *this;
    r.data = static_cast<char*>(data) + static_cast<size_t>(first * stride) * dtype_size(dtype);
    r.count = n;
    return r;
  }
  size_t bytes() const { return static_cast<size_t>(count * stride) * dtype_size(dtype); }
};

// Full-matrix bytes per bucket of the distributed engine where none is set
// (DistOptions::bucket_bytes), and so the simulator's and the tools' default: one place.
// 1 GiB: on the one-GPU cluster at D = 8 (H200, 2026-12-06) it took the sharded step 19-28 % and
// the dedicated step 32-36 % below 32 MiB's on pi0 and qwen2.5-7b (fewer launches, and less
// compute slowed beside NCCL kernels); every bucket's buffers exist from set-up on, so the size
// costs no memory.
inline constexpr int64_t kDefaultBucketBytes = int64_t{1} << 30;

}  // namespace distmuon
