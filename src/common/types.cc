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
