// Helpers of the CUDA tests: skip without a GPU, move HostBatch data to and from the device.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "distmuon/cuda_backend.h"
#include "test_util.h"

namespace distmuon::test {

#define DM_SKIP_WITHOUT_CUDA() \
  if (!::distmuon::cuda_available()) GTEST_SKIP() << "no CUDA device"

inline CudaBackend& cuda_backend() {
  static std::unique_ptr<CudaBackend> be;
  if (!be) be = std::make_unique<CudaBackend>(CudaBackendOptions{0, 0});
  return *be;
}

// A device copy of a HostBatch with the same layout.
struct DeviceBatch {
  Buffer buf;
  BatchRef ref;
  DeviceBatch(Backend& be, const HostBatch& h) {
    buf = be.alloc(h.bytes.size());
    be.copy_from_host(buf.data(), h.bytes.data(), h.bytes.size());
    ref = h.ref;
    ref.data = buf.data();
  }
  void download(Backend& be, HostBatch& h) const {
    be.copy_to_host(h.bytes.data(), buf.data(), h.bytes.size());
  }
};

}  // namespace distmuon::test
