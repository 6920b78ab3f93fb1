#include "distmuon/types.h"

#include "distmuon/error.h"

namespace distmuon {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF64: return 8;
    case DType::kF32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
  }
  DM_FAIL("unknown dtype ", static_cast<int>(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF64: return "f64";
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

DType parse_dtype(const std::string& s) {
  if (s == "f64" || s == "float64" || s == "double") return DType::kF64;
  if (s == "f32" || s == "float32" || s == "float") return DType::kF32;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  if (s == "f16" || s == "fp16" || s == "float16" || s == "half") return DType::kF16;
  DM_FAIL("unsupported dtype '", s, "' (expected f64, f32, bf16 or f16)");
}

namespace {
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}
}  // namespace

int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  DM_CHECK(a >= 0 && b >= 0, what, ": negative size (", a, " x ", b, ")");
  int64_t r = 0;
  DM_CHECK(!__builtin_mul_overflow(a, b, &r), what, ": ", a, " x ", b,
           " overflows a 64-bit size");
  return r;
}

int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  DM_CHECK(a >= 0 && b >= 0, what, ": negative size (", a, " + ", b, ")");
  int64_t r = 0;
  DM_CHECK(!__builtin_add_overflow(a, b, &r), what, ": ", a, " + ", b,
           " overflows a 64-bit size");
  return r;
}

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    DM_CHECK(d >= 0, what, ": shape ", shape_text(shape), " has a negative dimension");
    DM_CHECK(!__builtin_mul_overflow(n, d, &n), what, ": shape ", shape_text(shape),
             " has more elements than a 64-bit size holds");
  }
  return n;
}

int64_t checked_bytes(int64_t numel, DType t, const std::string& what) {
  return checked_mul(numel, static_cast<int64_t>(dtype_size(t)), what + " (bytes)");
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TensorView::is_contiguous() const {
  if (strides.empty()) return true;
  int64_t expect = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

TensorView TensorView::contiguous(void* data, std::vector<int64_t> shape, DType dtype,
                                  Device device) {
  TensorView v;
  v.data = data;
  v.shape = std::move(shape);
  v.dtype = dtype;
  v.device = device;
  v.strides.resize(v.shape.size());
  int64_t s = 1;
  for (size_t i = v.shape.size(); i-- > 0;) {
    v.strides[i] = s;
    s *= v.shape[i];
  }
  return v;
}

}  // namespace distmuon
