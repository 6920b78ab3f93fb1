// Translation between DLPack arrays (nanobind's nb::ndarray, which torch tensors convert to
// without a copy) and the C++ core's raw buffers and TensorViews. Nothing here computes.
#pragma once

#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>
#include <vector>

#include "distmuon/types.h"

namespace distmuon::py {

namespace nb = nanobind;
using Array = nb::ndarray<>;  // any dtype, shape, device; no implicit conversion (never a copy)

// The core's dtype of a DLPack dtype; throws ValueError naming `what` for anything else
// (integers, complex, fp8, ...).
DType to_dtype(nb::dlpack::dtype t, const std::string& what);
nb::dlpack::dtype to_dlpack(DType t);
// DLPack device type (kDLCPU = 1, kDLCUDA = 2) of a core device and back.
int to_dlpack_device(const Device& d);
Device to_device(const Array& a);

std::vector<int64_t> shape_of(const Array& a);
// C-contiguous in the sense of TensorView::is_contiguous (size-1 dimensions may have any stride).
bool is_contiguous(const Array& a);

// A DLPack view of a buffer in backend memory, kept alive by `owner` (the Python object that
// owns the memory).
Array view_of(const TensorView& v, nb::handle owner);

}  // namespace distmuon::py
