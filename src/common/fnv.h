// 64-bit FNV-1a: a digest of bytes that is the same in every process and on every machine, for
// the checks that ranks agree (set-up, each step's options, plans) and for cache keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace distmuon {

inline constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;

inline uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* c = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 0x100000001b3ull;
  return h;
}

inline uint64_t fnv1a(std::string_view s) { return fnv1a(kFnvOffset, s.data(), s.size()); }

}  // namespace distmuon
