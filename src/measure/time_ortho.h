// Timing the Orthogonalizer: the one measurement that the planner's cost profile and the
// algorithm tuner both take, on the same inputs and through the same clock (Backend::time_ms).
#pragma once

#include <cstdint>

#include "distmuon/backend.h"
#include "distmuon/ortho.h"

namespace distmuon::measure {

// count random m x n matrices (Backend::fill_normal with `seed`) normalised as a Muon step
// normalises its input for `base`'s coefficients, in fp32: what every measurement runs on.
struct OrthoInput {
  Buffer storage;
  BatchRef batch;
};
OrthoInput make_ortho_input(Backend& be, int64_t m, int64_t n, int64_t count,
                            const OrthoConfig& base, uint64_t seed);

struct OrthoTiming {
  int warmup = 1;   // untimed runs first (plans, kernel attributes, caches)
  int repeats = 3;  // timed runs; the median is kept (0: none, for `results` alone)
  // Time replays of the solve captured once (Backend::capture), as a single-process engine that
  // replays its step runs it, where the backend captures; else every run is issued. On a
  // launch-bound batch the two differ by the launch gaps a graph removes.
  bool graph = false;
};

// Median milliseconds of one orthogonalization of `input` with `cfg` (resolved here for the
// shape). Before each run the input is converted to the iteration's dtype, untimed (the
// iteration overwrites it). With `results` (fp32, at most input's count matrices), the first
// run's outputs are written there, for an accuracy check. 0 when timing.repeats is 0.
double time_orthogonalizer(Backend& be, const OrthoConfig& cfg, const BatchRef& input,
                           const OrthoTiming& timing, const BatchRef* results = nullptr);

}  // namespace distmuon::measure
