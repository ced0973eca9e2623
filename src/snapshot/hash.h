// The snapshot checksums: fast 64-bit non-cryptographic hashes that catch torn writes,
// truncation and bit rot, not attackers.
//
// A snapshot's data checksum is defined over *pieces*: every tensor is cut into pieces of at most
// kPieceBytes, each piece is hashed with a seed derived from (tensor index, piece index), and the
// piece hashes are folded in order. Pieces are independent, so any number of threads can hash
// them, and the result does not depend on the thread count.
//
// Two piece hashes exist. DataHash64 (format 2, written today) keeps eight 64-bit accumulators
// over 64-byte stripes with one 32x32->64-bit multiply per word, which vector units do four or
// eight at a time; Hash64 (format 1: files written before it, and the header and manifest hashes
// of every file) is a four-lane multiply-rotate chain, bound by the latency of 64-bit multiplies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace efdl::snapshot {

inline constexpr uint64_t kPieceBytes = uint64_t{1} << 20;

// The hash of format 1 (see above). Also hashes every file's header and manifest.
uint64_t Hash64(const void* data, size_t n, uint64_t seed);

// The data hash of format 2. Definition (every implementation must give exactly these values;
// tests/snapshot/hash_manifest_test.cc spells it out in plain code):
//   keys K[0..23]: splitmix64 outputs from the state 0x243F6A8885A308D3 (layout: K[j..j+7] for
//   stripe j of a block, K[8..15] for the scramble, K[16..23] for the start);
//   start: acc[i] = K[16+i] ^ Mix(seed + i), Mix the splitmix64 finalizer;
//   stripe j (0..15) of 64 bytes, words w[0..7] (little-endian): k = w[i] ^ K[j+i],
//     acc[i] += lo32(k) * hi32(k), acc[i^1] += w[i];
//   after stripe 15 of each 1 KiB block: acc[i] = (acc[i] ^ acc[i] >> 47 ^ K[8+i]) * 0x9E3779B1;
//   tail: the last n % 64 bytes (if any), zero-padded, as one more stripe;
//   result: h = seed ^ n * M3, h = Lane(h, acc[i]) for i = 0..7, then the finalizer of Hash64.
uint64_t DataHash64(const void* data, size_t n, uint64_t seed);

// DataHash64 in parts: Update() with whole 64-byte stripes, then Finish() with the rest (< 64
// bytes) and the total length. Not thread-safe (one per piece).
class DataHasher {
 public:
  static constexpr size_t kStripe = 64;
  // The code that runs the stripes; all give the same values. kBest: the fastest this CPU has
  // (AVX-512, then AVX2 on x86-64; NEON on AArch64; else portable).
  enum class Path { kBest, kPortable, kAvx2, kAvx512, kNeon };
  static bool Supported(Path path);
  static const char* Name(Path path);

  explicit DataHasher(uint64_t seed, Path path = Path::kBest);  // path must be Supported
  DataHasher& Update(const void* data, size_t n);  // n must be a multiple of kStripe
  uint64_t Finish(const void* tail, size_t n, uint64_t total) const;
  Path path() const { return path_; }

 private:
  Path path_;
  uint64_t seed_;
  uint64_t acc_[8];
  unsigned stripe_ = 0;  // stripe number inside the current 1 KiB block
};

// The piece hash of a snapshot format: 1 (Hash64) or 2 (DataHash64).
uint64_t PieceHash(int format, const void* data, size_t n, uint64_t seed);
inline constexpr int kCurrentDataFormat = 2;

// One piece of one tensor: bytes [offset, offset + length) of the data region.
struct Piece {
  uint32_t tensor = 0;
  uint32_t index = 0;   // piece number inside its tensor
  uint64_t offset = 0;  // from the start of the data region
  uint64_t length = 0;
  uint64_t Seed() const { return (uint64_t{tensor} << 32) | index; }
};

// Order-dependent combination of piece hashes into the snapshot's data checksum.
uint64_t FoldPieceHashes(const std::vector<uint64_t>& hashes);

}  // namespace efdl::snapshot
