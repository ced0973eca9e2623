#include "snapshot/hash.h"

#include <algorithm>
#include <array>
#include <cstring>

#if defined(__x86_64__)
// GCC 12 reports the AVX-512 intrinsics' own _mm512_undefined_epi32() as maybe uninitialized
// (GCC bug 105593, fixed in 13); the warning is located in this header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

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

// Hash64's state: four lanes, each a multiply-rotate chain over every fourth word.
struct Lanes {
  uint64_t a, b, c, d;
  explicit Lanes(uint64_t seed)
      : a(seed + kM1), b(seed ^ kM2), c(Rotl(seed, 17) + kM3), d(~seed * kM1) {}
  // The whole 32-byte blocks of p[0, n). (An AVX-512 version of the four lanes measured 20%
  // slower on the development VM's Zen 4: the chain per block is latency-bound.)
  void Blocks(const unsigned char* p, size_t n) {
    for (size_t i = 0; i + 32 <= n; i += 32) {
      a = Lane(a, Load64(p + i));
      b = Lane(b, Load64(p + i + 8));
      c = Lane(c, Load64(p + i + 16));
      d = Lane(d, Load64(p + i + 24));
    }
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
  const size_t whole = n & ~size_t{31};
  Lanes l(seed);
  l.Blocks(p, whole);
  return l.Tail(p + whole, n - whole, n);
}

namespace {

// -- DataHash64 (format 2) -------------------------------------------------------------------

constexpr uint64_t SplitMixFinal(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

constexpr std::array<uint64_t, 24> MakeKeys() {
  std::array<uint64_t, 24> keys{};
  uint64_t state = 0x243F6A8885A308D3ULL;
  for (auto& k : keys) {
    state += kM1;
    k = SplitMixFinal(state);
  }
  return keys;
}

constexpr std::array<uint64_t, 24> kKeys = MakeKeys();
constexpr uint64_t kScrambleMul = 0x9E3779B1ULL;
constexpr unsigned kStripesPerBlock = 16;

void StripesPortable(uint64_t* acc, const unsigned char* p, size_t stripes, unsigned* stripe) {
  unsigned j = *stripe;
  for (size_t s = 0; s < stripes; ++s, p += 64) {
    for (unsigned i = 0; i < 8; ++i) {
      const uint64_t w = Load64(p + 8 * i);
      const uint64_t k = w ^ kKeys[j + i];
      acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
      acc[i ^ 1] += w;
    }
    if (++j == kStripesPerBlock) {
      j = 0;
      for (unsigned i = 0; i < 8; ++i) {
        acc[i] = (acc[i] ^ (acc[i] >> 47) ^ kKeys[8 + i]) * kScrambleMul;
      }
    }
  }
  *stripe = j;
}

#if defined(__x86_64__)
// The same arithmetic, four lanes per instruction: 32x32->64 multiplies (vpmuludq) and a swap of
// the 64-bit halves of each 128-bit lane for acc[i ^ 1] += w[i].
__attribute__((target("avx2"))) __m256i Scramble(__m256i a, const uint64_t* key) {
  const __m256i mul = _mm256_set1_epi64x(static_cast<long long>(kScrambleMul));
  a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
  a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  const __m256i lo = _mm256_mul_epu32(a, mul);
  const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), mul);
  return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

__attribute__((target("avx2"))) __m256i Accumulate(__m256i acc, const unsigned char* p,
                                                   const uint64_t* key) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i k = _mm256_xor_si256(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key)));
  const __m256i product = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));
  const __m256i swapped = _mm256_shuffle_epi32(w, _MM_SHUFFLE(1, 0, 3, 2));
  return _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped));
}

__attribute__((target("avx2"))) void StripesAvx2(uint64_t* acc, const unsigned char* p,
                                                 size_t stripes, unsigned* stripe) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4));
  unsigned j = *stripe;
  for (size_t s = 0; s < stripes; ++s, p += 64) {
    a0 = Accumulate(a0, p, kKeys.data() + j);
    a1 = Accumulate(a1, p + 32, kKeys.data() + j + 4);
    if (++j == kStripesPerBlock) {
      j = 0;
      a0 = Scramble(a0, kKeys.data() + 8);
      a1 = Scramble(a1, kKeys.data() + 12);
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a1);
  *stripe = j;
}

// All eight lanes in one register.
__attribute__((target("avx512f"))) void StripesAvx512(uint64_t* acc, const unsigned char* p,
                                                     size_t stripes, unsigned* stripe) {
  const __m512i mul = _mm512_set1_epi64(static_cast<long long>(kScrambleMul));
  __m512i a = _mm512_loadu_si512(acc);
  unsigned j = *stripe;
  for (size_t s = 0; s < stripes; ++s, p += 64) {
    const __m512i w = _mm512_loadu_si512(p);
    const __m512i k = _mm512_xor_si512(w, _mm512_loadu_si512(kKeys.data() + j));
    const __m512i product = _mm512_mul_epu32(k, _mm512_srli_epi64(k, 32));
    a = _mm512_add_epi64(a, _mm512_add_epi64(product, _mm512_shuffle_epi32(w, _MM_PERM_BADC)));
    if (++j == kStripesPerBlock) {
      j = 0;
      a = _mm512_xor_si512(a, _mm512_srli_epi64(a, 47));
      a = _mm512_xor_si512(a, _mm512_loadu_si512(kKeys.data() + 8));
      const __m512i lo = _mm512_mul_epu32(a, mul);
      const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), mul);
      a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
    }
  }
  _mm512_storeu_si512(acc, a);
  *stripe = j;
}
#endif

#if defined(__aarch64__)
// The same arithmetic on NEON (every AArch64 CPU has it), two lanes per register: vmull_u32 is
// the 32x32->64 multiply, vextq_u64 the swap of the two 64-bit halves.
uint64x2_t Scramble(uint64x2_t a, const uint64_t* key) {
  const uint32x2_t mul = vdup_n_u32(static_cast<uint32_t>(kScrambleMul));
  a = veorq_u64(a, vshrq_n_u64(a, 47));
  a = veorq_u64(a, vld1q_u64(key));
  const uint64x2_t lo = vmull_u32(vmovn_u64(a), mul);
  const uint64x2_t hi = vmull_u32(vshrn_n_u64(a, 32), mul);
  return vaddq_u64(lo, vshlq_n_u64(hi, 32));
}

uint64x2_t Accumulate(uint64x2_t acc, const unsigned char* p, const uint64_t* key) {
  const uint64x2_t w = vreinterpretq_u64_u8(vld1q_u8(p));
  const uint64x2_t k = veorq_u64(w, vld1q_u64(key));
  const uint64x2_t product = vmull_u32(vmovn_u64(k), vshrn_n_u64(k, 32));
  return vaddq_u64(acc, vaddq_u64(product, vextq_u64(w, w, 1)));
}

void StripesNeon(uint64_t* acc, const unsigned char* p, size_t stripes, unsigned* stripe) {
  uint64x2_t a[4];
  for (int r = 0; r < 4; ++r) a[r] = vld1q_u64(acc + 2 * r);
  unsigned j = *stripe;
  for (size_t s = 0; s < stripes; ++s, p += 64) {
    for (int r = 0; r < 4; ++r) a[r] = Accumulate(a[r], p + 16 * r, kKeys.data() + j + 2 * r);
    if (++j == kStripesPerBlock) {
      j = 0;
      for (int r = 0; r < 4; ++r) a[r] = Scramble(a[r], kKeys.data() + 8 + 2 * r);
    }
  }
  for (int r = 0; r < 4; ++r) vst1q_u64(acc + 2 * r, a[r]);
  *stripe = j;
}
#endif

}  // namespace

bool DataHasher::Supported(Path path) {
  switch (path) {
    case Path::kBest:
    case Path::kPortable:
      return true;
#if defined(__x86_64__)
    case Path::kAvx2:
      return __builtin_cpu_supports("avx2");
    case Path::kAvx512:
      return __builtin_cpu_supports("avx512f");
#elif defined(__aarch64__)
    case Path::kNeon:
      return true;
#endif
    default:
      return false;
  }
}

const char* DataHasher::Name(Path path) {
  switch (path) {
    case Path::kBest: return "best";
    case Path::kPortable: return "portable";
    case Path::kAvx2: return "avx2";
    case Path::kAvx512: return "avx512";
    case Path::kNeon: return "neon";
  }
  return "?";
}

namespace {

DataHasher::Path BestPath() {
  using Path = DataHasher::Path;
  for (Path p : {Path::kAvx512, Path::kAvx2, Path::kNeon}) {
    if (DataHasher::Supported(p)) return p;
  }
  return Path::kPortable;
}

}  // namespace

DataHasher::DataHasher(uint64_t seed, Path path) : path_(path), seed_(seed) {
  if (path_ == Path::kBest) {
    static const Path best = BestPath();
    path_ = best;
  }
  for (unsigned i = 0; i < 8; ++i) acc_[i] = kKeys[16 + i] ^ SplitMixFinal(seed + i);
}

DataHasher& DataHasher::Update(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  switch (path_) {
#if defined(__x86_64__)
    case Path::kAvx512:
      StripesAvx512(acc_, p, n / kStripe, &stripe_);
      return *this;
    case Path::kAvx2:
      StripesAvx2(acc_, p, n / kStripe, &stripe_);
      return *this;
#elif defined(__aarch64__)
    case Path::kNeon:
      StripesNeon(acc_, p, n / kStripe, &stripe_);
      return *this;
#endif
    default:
      StripesPortable(acc_, p, n / kStripe, &stripe_);
      return *this;
  }
}

uint64_t DataHasher::Finish(const void* tail, size_t n, uint64_t total) const {
  uint64_t acc[8];
  std::memcpy(acc, acc_, sizeof(acc));
  if (n > 0) {
    unsigned char last[kStripe] = {};
    std::memcpy(last, tail, std::min(n, kStripe));
    unsigned stripe = stripe_;
    StripesPortable(acc, last, 1, &stripe);
  }
  uint64_t h = seed_ ^ (total * kM3);
  for (uint64_t a : acc) h = Lane(h, a);
  return Finalize(h);
}

uint64_t DataHash64(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const size_t whole = n - n % DataHasher::kStripe;
  return DataHasher(seed).Update(p, whole).Finish(p + whole, n - whole, n);
}

uint64_t PieceHash(int format, const void* data, size_t n, uint64_t seed) {
  return format == 1 ? Hash64(data, n, seed) : DataHash64(data, n, seed);
}

uint64_t FoldPieceHashes(const std::vector<uint64_t>& hashes) {
  uint64_t h = kM1 ^ hashes.size();
  for (uint64_t v : hashes) h = Finalize(Lane(h, v));
  return h;
}

}  // namespace efdl::snapshot
