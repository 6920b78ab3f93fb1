// Shared helpers of the C++ tests: random inputs, host buffers in any dtype, and the float64
// reference of the Newton-Schulz family written independently of the library (Eigen).
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <random>
#include <vector>

#include "distmuon/backend.h"
#include "distmuon/ortho.h"

namespace distmuon::test {

using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// A fresh generator per test, seeded from the test name and a counter, so failures reproduce.
std::mt19937_64& rng();
Mat random_matrix(int64_t rows, int64_t cols, double scale = 1.0);
// Each matrix of `base` plus eps times its RMS entry times fresh Gaussian noise (the next step's
// slightly moved momentum, for CacheMuon).
std::vector<Mat> drifted(const std::vector<Mat>& base, double eps);

// Host-side storage of `count` rows x cols matrices in `dtype`, as the CPU backend reads them.
struct HostBatch {
  std::vector<uint8_t> bytes;
  BatchRef ref;
  HostBatch(DType dtype, int64_t count, int64_t rows, int64_t cols);
  void set(int64_t b, const Mat& m);  // rounds to dtype
  Mat get(int64_t b) const;
  void poison();  // fills with NaN so that unwritten outputs are caught
};

// The float64 reference of standard Newton-Schulz with the given schedule on U (any shape):
// normalise, iterate in the wide orientation, transpose back.
Mat reference_ns(const Mat& u, Coefficients coeffs, int steps);
// Polar factor U (U^T U)^(-1/2) by SVD.
Mat polar_factor(const Mat& u);
double rel_err(const Mat& a, const Mat& ref);  // ||a - ref||_F / max(||ref||_F, tiny)
std::vector<float> to_vec(const Mat& m);       // row-major float copy (an fp32 parameter's memory)

}  // namespace distmuon::test
