// The algorithm choice of a shape nobody measured, predicted from the shapes that were: each
// candidate's time is its analytic batch time (plan/cost_analytic.cc: counted FLOPs over the GEMM
// rate, bytes over the bandwidth, a fixed cost per launch) times the measured-over-analytic ratio
// of that candidate on the nearest measured shapes. The ratio carries what the analytic model
// misses for a size and aspect (the symmetric kernels' rate on small products, the Gram
// iteration's extra launches where a batch is launch-bound); the analytic part carries the
// scaling from there to the new shape and batch size.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "measure/tuner.h"

namespace distmuon::measure {

struct ModelOptions {
  int neighbours = 3;       // measured shapes whose ratios are averaged (inverse-distance weights)
  double tolerance = kAcceptTolerance;  // offered where its predicted error is within this
};

// Distance between two shape classes in the model's features: log of the short side, log of the
// aspect ratio, and half the log of the batch size (a batch changes the rate less than a side).
double shape_distance(int64_t m1, int64_t n1, int64_t k1, int64_t m2, int64_t n2, int64_t k2);

// The predicted choice for count wide m x n matrices from `measured` (entries of other shapes or
// batch sizes, measured with `schedule`): every candidate measured somewhere gets a predicted
// time in `ms` and a predicted error in `rel_err` (the same weighted mean, of the logarithms of
// the neighbours' errors against the fp32 iteration); it is accepted where that error is within
// opt.tolerance, as the tuner's check would accept it (the error grows as m shrinks: bf16 ns5
// fails the check at m = 32, passes at 64). The
// choice's algorithm is the fastest accepted prediction (as select_candidate's policy then
// narrows it). nullopt when no entry of that schedule has a measured candidate.
std::optional<AlgoChoice> predict_choice(const std::vector<AlgoChoice>& measured, int64_t m,
                                         int64_t n, int64_t count, const OrthoConfig& base,
                                         const ModelOptions& opt = {});

}  // namespace distmuon::measure
