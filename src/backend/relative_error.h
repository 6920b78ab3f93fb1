// The accuracy measure the tuners share (the kernel-variant tuner here, the algorithm tuner in
// src/measure): computed with Backend operations, so on the device that produced the batches.
#pragma once

#include "distmuon/backend.h"

namespace distmuon {

// ||a - b||_F / ||b||_F over whole batches of one shape and dtype; infinity when it is not
// finite (a NaN output is never accurate).
double relative_error(Backend& be, const BatchRef& a, const BatchRef& b);

}  // namespace distmuon
