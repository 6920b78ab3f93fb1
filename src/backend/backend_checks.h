// Argument checks shared by every backend, so that a misuse fails with the same message on the
// CPU and on the GPU.
#pragma once

#include <span>

#include "distmuon/backend.h"
#include "distmuon/error.h"

namespace distmuon {

struct GemmDims {
  int64_t m, n, k;  // C (m x n) = op(A) (m x k) op(B) (k x n)
};

// Validates a batched product and returns its dimensions.
GemmDims check_gemm(const char* what, Op op_a, const BatchRef& a, Op op_b, const BatchRef& b,
                    const BatchRef* c_in, const BatchRef& c);
// Validates that x can hold the slots' matrices (transposed when `transpose`).
void check_slots(const char* what, std::span<const MuonSlot> slots, const BatchRef& x,
                 bool transpose);
// Every slot names its coefficients (MuonSlot::coef / AdamSlot::coef).
template <typename Slot>
void check_coefs(const char* what, std::span<const Slot> slots) {
  for (size_t i = 0; i < slots.size(); ++i)
    DM_CHECK(slots[i].coef != nullptr, what, ": slot ", i, " has no coefficients");
}
void check_same_shape(const char* what, const BatchRef& a, const BatchRef& b);
// Every copy of a copy_blocks call, before any is issued.
void check_block_copies(std::span<const BlockCopy> copies);
// Validates lincomb's operands (b may be null; an identity term needs square matrices).
void check_lincomb(const char* what, const BatchRef& a, const BatchRef* b, double diag,
                   const BatchRef& out);

}  // namespace distmuon
