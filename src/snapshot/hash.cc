#include "snapshot/hash.h"

#include <cstring>

namespace efdl::snapshot {

namespace {

constexpr uint64_t kM1 = 0x9E3779B97F4A7C15ULL;  // golden ratio
constexpr uint64_t kM2 = 0xD6E8FEB86659FD93ULL;
constexpr uint64_t kM3 = 0xFF51AFD7ED558CCDULL;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline uint64_t Lane(uint64_t acc, uint64_t v) { return Rotl(acc ^ (v * kM2), 27) * kM1; }
inline uint64_t Finalize(uint64_t x) {
  x ^= x >> 32;
  x *= kM3;
  x ^= x >> 29;
  x *= kM2;
  x ^= x >> 32;
  return x;
}

struct Lanes {
  uint64_t a, b, c, d;
  explicit Lanes(uint64_t seed)
      : a(seed + kM1), b(seed ^ kM2), c(Rotl(seed, 17) + kM3), d(~seed * kM1) {}
  void Block(const unsigned char* p) {
    a = Lane(a, Load64(p));
    b = Lane(b, Load64(p + 8));
    c = Lane(c, Load64(p + 16));
    d = Lane(d, Load64(p + 24));
  }
  uint64_t Tail(const unsigned char* p, size_t rest, size_t total) const {
    uint64_t h = Rotl(a, 1) + Rotl(b, 7) + Rotl(c, 12) + Rotl(d, 18) + total * kM3;
    while (rest >= 8) {
      h = Lane(h, Load64(p));
      p += 8;
      rest -= 8;
    }
    if (rest > 0) {
      uint64_t v = 0;
      std::memcpy(&v, p, rest);
      h = Lane(h, v ^ (rest << 56));
    }
    return Finalize(h);
  }
};

}  // namespace

uint64_t Hash64(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  Lanes lanes(seed);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) lanes.Block(p + i);
  return lanes.Tail(p + i, n - i, n);
}

uint64_t CopyAndHash64(void* dst, const void* src, size_t n, uint64_t seed) {
  // Copy in 4 KiB strides with memcpy (it picks the best instructions) and hash the destination
  // while it is still in L1: one pass over memory.
  constexpr size_t kStride = 4096;
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  Lanes lanes(seed);
  size_t i = 0;
  while (n - i >= 32) {
    size_t chunk = std::min(kStride, (n - i) & ~size_t{31});
    std::memcpy(d + i, s + i, chunk);
    for (size_t j = 0; j < chunk; j += 32) lanes.Block(d + i + j);
    i += chunk;
  }
  // memcpy with a null pointer is undefined even for 0 bytes, and an empty tensor may have none.
  if (n > i) std::memcpy(d + i, s + i, n - i);
  return lanes.Tail(d + i, n - i, n);
}

uint64_t FoldPieceHashes(const std::vector<uint64_t>& hashes) {
  uint64_t h = kM1 ^ hashes.size();
  for (uint64_t v : hashes) h = Finalize(Lane(h, v));
  return h;
}

}  // namespace efdl::snapshot
