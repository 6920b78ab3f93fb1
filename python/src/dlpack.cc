#include "dlpack.h"

#include <stdexcept>

namespace distmuon::py {

namespace {
constexpr int kDLCPU = 1, kDLCUDA = 2;
}

DType to_dtype(nb::dlpack::dtype t, const std::string& what) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == static_cast<uint8_t>(Code::Float) && t.bits == 32) return DType::kF32;
    if (t.code == static_cast<uint8_t>(Code::Float) && t.bits == 64) return DType::kF64;
    if (t.code == static_cast<uint8_t>(Code::Float) && t.bits == 16) return DType::kF16;
    if (t.code == static_cast<uint8_t>(Code::Bfloat) && t.bits == 16) return DType::kBF16;
  }
  const bool complex = t.code == static_cast<uint8_t>(Code::Complex) ||
                       t.code == static_cast<uint8_t>(Code::Bcomplex);
  throw nb::value_error((what + (complex ? " is complex" : " has an unsupported dtype") +
                         " (DLPack code " + std::to_string(t.code) + ", " +
                         std::to_string(t.bits) + " bits): distmuon handles float32, float64, "
                         "bfloat16 and float16")
                            .c_str());
}

nb::dlpack::dtype to_dlpack(DType t) {
  using Code = nb::dlpack::dtype_code;
  switch (t) {
    case DType::kF64: return {static_cast<uint8_t>(Code::Float), 64, 1};
    case DType::kF32: return {static_cast<uint8_t>(Code::Float), 32, 1};
    case DType::kF16: return {static_cast<uint8_t>(Code::Float), 16, 1};
    case DType::kBF16: return {static_cast<uint8_t>(Code::Bfloat), 16, 1};
  }
  throw std::logic_error("unknown dtype");
}

int to_dlpack_device(const Device& d) { return d.kind == DeviceKind::kCUDA ? kDLCUDA : kDLCPU; }

Device to_device(const Array& a) {
  if (a.device_type() == kDLCPU) return Device{DeviceKind::kCPU, 0};
  if (a.device_type() == kDLCUDA) return Device{DeviceKind::kCUDA, a.device_id()};
  throw nb::value_error(("unsupported DLPack device type " + std::to_string(a.device_type()) +
                         " (distmuon runs on CPU and CUDA memory)")
                            .c_str());
}

std::vector<int64_t> shape_of(const Array& a) {
  std::vector<int64_t> s(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) s[i] = static_cast<int64_t>(a.shape(i));
  return s;
}

bool is_contiguous(const Array& a) {
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect) return false;
    expect *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

Array view_of(const TensorView& v, nb::handle owner) {
  std::vector<size_t> shape(v.shape.begin(), v.shape.end());
  return Array(v.data, shape.size(), shape.data(), owner, v.strides.data(), to_dlpack(v.dtype),
               to_dlpack_device(v.device), v.device.index);
}

}  // namespace distmuon::py
