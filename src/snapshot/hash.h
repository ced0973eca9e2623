// The snapshot checksum: a fast 64-bit non-cryptographic hash (four independent multiply-rotate
// lanes over 32-byte blocks) that catches torn writes, truncation and bit rot, not attackers.
//
// A snapshot's data checksum is defined over *pieces*: every tensor is cut into pieces of at most
// kPieceBytes, each piece is hashed with a seed derived from (tensor index, piece index), and the
// piece hashes are folded in order. Pieces are independent, so any number of threads can hash (or
// copy-and-hash) them, and the result does not depend on the thread count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace efdl::snapshot {

inline constexpr uint64_t kPieceBytes = uint64_t{1} << 20;

uint64_t Hash64(const void* data, size_t n, uint64_t seed);

// Hash64 in parts, for hashing data while it is still in the cache after reading a part of it:
// Update() with any number of whole 32-byte blocks, then Finish() with the rest (< 32 bytes) and
// the total length. Hash64(d, n, s) == Hasher64(s).Update(d, n & ~31).Finish(d + (n & ~31),
// n & 31, n). Not thread-safe (one per piece).
class Hasher64 {
 public:
  explicit Hasher64(uint64_t seed);
  Hasher64& Update(const void* data, size_t n);  // n must be a multiple of 32
  uint64_t Finish(const void* tail, size_t n, uint64_t total) const;

 private:
  uint64_t lanes_[4];
};
// Copies n bytes from src to dst and returns Hash64(src, n, seed) in the same pass.
uint64_t CopyAndHash64(void* dst, const void* src, size_t n, uint64_t seed);

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
