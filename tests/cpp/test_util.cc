#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "backend/muon_ref.h"
#include "common/half.h"

namespace distmuon::test {

std::mt19937_64& rng() {
  static std::mt19937_64 gen;
  static std::string last_test;
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  if (name != last_test) {
    last_test = name;
    gen.seed(std::hash<std::string>{}(name) ^ static_cast<uint64_t>(std::random_device{}()));
  }
  return gen;
}

Mat random_matrix(int64_t rows, int64_t cols, double scale) {
  std::normal_distribution<double> d(0.0, scale);
  Mat m(rows, cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) m(i, j) = d(rng());
  return m;
}

std::vector<Mat> drifted(const std::vector<Mat>& base, double eps) {
  std::vector<Mat> r;
  for (const Mat& b : base)
    r.push_back(b +
                eps * b.norm() / std::sqrt(double(b.size())) * random_matrix(b.rows(), b.cols()));
  return r;
}

HostBatch::HostBatch(DType dtype, int64_t count, int64_t rows, int64_t cols)
    : bytes(static_cast<size_t>(count * rows * cols) * dtype_size(dtype) + 1) {
  ref = BatchRef::packed(bytes.data(), dtype, count, rows, cols);
}

void HostBatch::set(int64_t b, const Mat& m) {
  MatRef r = ref.matrix(b);
  for (int64_t i = 0; i < r.rows; ++i)
    for (int64_t j = 0; j < r.cols; ++j) {
      const double v = m(i, j);
      const int64_t k = i * r.ld + j;
      switch (r.dtype) {
        case DType::kF64: static_cast<double*>(r.data)[k] = v; break;
        case DType::kF32: static_cast<float*>(r.data)[k] = static_cast<float>(v); break;
        case DType::kBF16: static_cast<uint16_t*>(r.data)[k] = float_to_bf16(static_cast<float>(v)); break;
        case DType::kF16: static_cast<uint16_t*>(r.data)[k] = float_to_f16(static_cast<float>(v)); break;
      }
    }
}

Mat HostBatch::get(int64_t b) const {
  MatRef r = ref.matrix(b);
  Mat m(r.rows, r.cols);
  for (int64_t i = 0; i < r.rows; ++i)
    for (int64_t j = 0; j < r.cols; ++j) {
      const int64_t k = i * r.ld + j;
      switch (r.dtype) {
        case DType::kF64: m(i, j) = static_cast<const double*>(r.data)[k]; break;
        case DType::kF32: m(i, j) = static_cast<const float*>(r.data)[k]; break;
        case DType::kBF16: m(i, j) = bf16_to_float(static_cast<const uint16_t*>(r.data)[k]); break;
        case DType::kF16: m(i, j) = f16_to_float(static_cast<const uint16_t*>(r.data)[k]); break;
      }
    }
  return m;
}

void HostBatch::poison() {
  Mat nan = Mat::Constant(ref.rows, ref.cols, std::numeric_limits<double>::quiet_NaN());
  for (int64_t b = 0; b < ref.count; ++b) set(b, nan);
}

Mat reference_ns(const Mat& u, Coefficients coeffs, int steps) {
  const bool tall = u.rows() > u.cols();
  Mat x = tall ? Mat(u.transpose()) : u;
  // The library keeps norms to float's precision (in double's range); round here too so that
  // the comparison measures the iteration, not the 1e-7 of the norm that early Polar Express
  // steps amplify.
  const double norm = muon_ref::float_precision(u.norm());
  x /= (norm * norm_multiplier(coeffs) + 1e-7);
  for (const QuinticCoef& k : coefficient_schedule(coeffs, steps)) {
    Mat a = x * x.transpose();
    Mat b = k.b * a + k.c * a * a;
    x = k.a * x + b * x;
  }
  return tall ? Mat(x.transpose()) : x;
}

Mat polar_factor(const Mat& u) {
  Eigen::JacobiSVD<Mat> svd(u, Eigen::ComputeThinU | Eigen::ComputeThinV);
  return svd.matrixU() * svd.matrixV().transpose();
}

double rel_err(const Mat& a, const Mat& ref) {
  if (a.hasNaN()) return std::numeric_limits<double>::infinity();
  return (a - ref).norm() / std::max(ref.norm(), 1e-300);
}

std::vector<float> to_vec(const Mat& m) {
  std::vector<float> v(static_cast<size_t>(m.size()));
  for (int64_t i = 0; i < m.rows(); ++i)
    for (int64_t j = 0; j < m.cols(); ++j) v[i * m.cols() + j] = static_cast<float>(m(i, j));
  return v;
}

}  // namespace distmuon::test
