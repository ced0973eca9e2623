#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "efdl/snapshot.h"
#include "snapshot/hash.h"
#include "snapshot/layout.h"
#include "snapshot/parallel.h"
#include "snapshot/snapshot_file.h"
#include "snapshot/stream_copy.h"

namespace efdl::snapshot {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(gen());
  return v;
}

// The pieces both hashes' definitions share, written out plainly (no code shared with hash.cc).
constexpr uint64_t m1 = 0x9E3779B97F4A7C15ULL, m2 = 0xD6E8FEB86659FD93ULL,
                   m3 = 0xFF51AFD7ED558CCDULL;
uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
uint64_t load(const uint8_t* q) {
  uint64_t v = 0;
  for (int b = 7; b >= 0; --b) v = (v << 8) | q[b];  // little-endian, as the x86 loads
  return v;
}
uint64_t lane(uint64_t acc, uint64_t v) { return rotl(acc ^ (v * m2), 27) * m1; }
uint64_t finalize(uint64_t h) {
  h ^= h >> 32;
  h *= m3;
  h ^= h >> 29;
  h *= m2;
  h ^= h >> 32;
  return h;
}

// Format 1's piece hash (and every file's header and manifest hash) written out plainly
// (hash.h): Hash64 must give exactly these values, or stored snapshots stop verifying.
uint64_t ReferenceHash64(const uint8_t* p, size_t n, uint64_t seed) {
  uint64_t l[4] = {seed + m1, seed ^ m2, rotl(seed, 17) + m3, ~seed * m1};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) l[k] = lane(l[k], load(p + i + 8 * k));
  }
  uint64_t h = rotl(l[0], 1) + rotl(l[1], 7) + rotl(l[2], 12) + rotl(l[3], 18) + n * m3;
  for (; n - i >= 8; i += 8) h = lane(h, load(p + i));
  if (n > i) {
    uint64_t v = 0;
    for (size_t b = n - i; b-- > 0;) v = (v << 8) | p[i + b];
    h = lane(h, v ^ (uint64_t{n - i} << 56));
  }
  return finalize(h);
}

TEST(Hash, Hash64MatchesItsDefinition) {
  for (size_t n : {0, 5, 31, 32, 255, 256, 257, 1000, 4096 + 17, (1 << 20) + 13}) {
    auto data = RandomBytes(n, static_cast<uint32_t>(n) + 3);
    EXPECT_EQ(Hash64(data.data(), n, 77), ReferenceHash64(data.data(), n, 77)) << n;
    EXPECT_EQ(PieceHash(1, data.data(), n, 77), ReferenceHash64(data.data(), n, 77)) << n;
  }
}

// Format 2's piece hash written out plainly, from the definition in hash.h (no shared code with
// hash.cc): the portable and the AVX2 DataHasher, whole or in parts, must give these values.
uint64_t ReferenceDataHash64(const uint8_t* p, size_t n, uint64_t seed) {
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  };
  uint64_t key[24];
  uint64_t state = 0x243F6A8885A308D3ULL;
  for (auto& k : key) k = mix(state += m1);
  uint64_t acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = key[16 + i] ^ mix(seed + static_cast<uint64_t>(i));
  std::vector<uint8_t> padded(p, p + n);
  padded.resize((n + 63) / 64 * 64, 0);
  for (size_t s = 0; s < padded.size() / 64; ++s) {
    const size_t j = s % 16;
    for (int i = 0; i < 8; ++i) {
      const uint64_t w = load(padded.data() + 64 * s + 8 * i);
      const uint64_t k = w ^ key[j + i];
      acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
      acc[i ^ 1] += w;
    }
    if (j == 15) {
      for (int i = 0; i < 8; ++i) acc[i] = (acc[i] ^ (acc[i] >> 47) ^ key[8 + i]) * 0x9E3779B1ULL;
    }
  }
  uint64_t h = seed ^ (n * m3);
  for (uint64_t a : acc) h = lane(h, a);
  return finalize(h);
}

TEST(Hash, DataHash64MatchesItsDefinitionOnEveryPathWholeOrInParts) {
  using Path = DataHasher::Path;
  std::vector<Path> paths;
  for (Path path : {Path::kPortable, Path::kAvx2, Path::kAvx512, Path::kNeon}) {
    if (DataHasher::Supported(path)) {
      paths.push_back(path);
    } else {
      GTEST_LOG_(INFO) << "this CPU has no " << DataHasher::Name(path) << " code path";
    }
  }
  EXPECT_NE(DataHasher(0).path(), Path::kBest);
  for (size_t n : {0, 1, 63, 64, 65, 1023, 1024, 1025, 4096 + 17, 100000, (1 << 20) + 13}) {
    auto data = RandomBytes(n, static_cast<uint32_t>(n) + 5);
    for (uint64_t seed : {uint64_t{0}, uint64_t{77}, (uint64_t{3} << 32) | 9}) {
      const uint64_t want = ReferenceDataHash64(data.data(), n, seed);
      EXPECT_EQ(DataHash64(data.data(), n, seed), want) << n;
      EXPECT_EQ(PieceHash(2, data.data(), n, seed), want) << n;
      const size_t whole = n - n % 64;
      for (Path path : paths) {
        // In parts of growing size, as a restore hashes each chunk it just read.
        DataHasher parts(seed, path);
        size_t i = 0;
        for (size_t step = 64; i < whole; step += 192) {
          const size_t len = std::min(step, whole - i);
          parts.Update(data.data() + i, len);
          i += len;
        }
        EXPECT_EQ(parts.Finish(data.data() + whole, n - whole, n), want)
            << n << " " << DataHasher::Name(path);
      }
    }
  }
}

// Stored snapshots depend on these exact values (also produced by the NEON code under
// qemu-aarch64 when the hash was written).
TEST(Hash, DataHash64AndHash64KeepTheirValuesOnAFixedInput) {
  std::vector<uint8_t> data(4113);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  EXPECT_EQ(DataHash64(data.data(), data.size(), 77), 0x2579d2f311696762ULL);
  EXPECT_EQ(DataHash64(data.data(), 63, 77), 0xf925e3633f0f2fafULL);
  EXPECT_EQ(Hash64(data.data(), data.size(), 77), 0xf2ac970b0f927c19ULL);
}

TEST(Hash, DataHash64SeesBitFlipsSwappedStripesZeroTailsAndSeeds) {
  auto data = RandomBytes(4096, 11);
  const uint64_t h = DataHash64(data.data(), data.size(), 0);
  EXPECT_NE(h, DataHash64(data.data(), data.size(), 1));
  for (size_t byte = 0; byte < data.size(); byte += 29) {
    for (int bit = 0; bit < 8; ++bit) {
      data[byte] ^= static_cast<uint8_t>(1 << bit);
      EXPECT_NE(h, DataHash64(data.data(), data.size(), 0)) << byte << ":" << bit;
      data[byte] ^= static_cast<uint8_t>(1 << bit);
    }
  }
  // Two 64-byte stripes swapped, inside one 1 KiB block and across blocks (a torn or misplaced
  // copy): the additive term alone would not see it, the keyed products must.
  for (auto [a, b] : {std::pair<size_t, size_t>{0, 1}, {3, 9}, {2, 18}, {0, 63}}) {
    auto swapped = data;
    std::swap_ranges(swapped.begin() + 64 * a, swapped.begin() + 64 * a + 64,
                     swapped.begin() + 64 * b);
    EXPECT_NE(h, DataHash64(swapped.data(), swapped.size(), 0)) << a << "<->" << b;
  }
  // Zero padding of the tail is not the data: a trailing zero byte changes the hash.
  std::vector<uint8_t> zeros(100, 0);
  EXPECT_NE(DataHash64(zeros.data(), 99, 0), DataHash64(zeros.data(), 100, 0));
  EXPECT_NE(DataHash64(zeros.data(), 0, 0), DataHash64(zeros.data(), 0, 1));
}

TEST(StreamCopy, CopiesEverySizeAndAlignmentWithoutWritingPastTheEnd) {
  for (size_t n : {0, 1, 15, 16, 63, 64, 4095, 4096, 4097, 4096 + 63, 100000, (1 << 20) + 13}) {
    auto src = RandomBytes(n + 16, static_cast<uint32_t>(n) + 7);
    for (size_t src_off : {0, 3}) {
      for (size_t dst_off : {0, 1, 8, 15}) {
        std::vector<uint8_t> dst(n + 32, 0xAB);
        StreamCopy(dst.data() + dst_off, src.data() + src_off, n);
        EXPECT_TRUE(std::equal(src.begin() + src_off, src.begin() + src_off + n,
                               dst.begin() + dst_off))
            << n << " " << src_off << " " << dst_off;
        for (size_t i = 0; i < dst_off; ++i) EXPECT_EQ(dst[i], 0xAB) << "wrote before the start";
        for (size_t i = dst_off + n; i < dst.size(); ++i) {
          EXPECT_EQ(dst[i], 0xAB) << "wrote past the end at n=" << n;
        }
      }
    }
  }
}

TEST(Hash, AnySingleBitFlipOrSeedChangeChangesTheHash) {
  auto data = RandomBytes(1000, 1);
  const uint64_t h = Hash64(data.data(), data.size(), 0);
  EXPECT_NE(h, Hash64(data.data(), data.size(), 1));
  EXPECT_NE(h, Hash64(data.data(), data.size() - 1, 0));
  for (size_t byte = 0; byte < data.size(); byte += 37) {
    for (int bit = 0; bit < 8; ++bit) {
      data[byte] ^= static_cast<uint8_t>(1 << bit);
      EXPECT_NE(h, Hash64(data.data(), data.size(), 0)) << byte << ":" << bit;
      data[byte] ^= static_cast<uint8_t>(1 << bit);
    }
  }
}

TEST(Layout, PiecesCoverEveryTensorByteOnceAndChecksumIgnoresThreadCount) {
  std::vector<TensorEntry> t = {{"a", "float32", {3}, 0, 12},
                                {"empty", "float32", {0}, 0, 0},
                                {"big", "uint8", {}, 0, 3 * kPieceBytes + 5}};
  const uint64_t total = AssignOffsets(t);
  EXPECT_EQ(t[0].offset, 0u);
  EXPECT_EQ(t[1].offset % kTensorAlign, 0u);
  EXPECT_GE(total, t[2].offset + t[2].nbytes);
  auto pieces = PiecesOf(t);
  ASSERT_EQ(pieces.size(), 1u + 1u + 4u);
  uint64_t covered = 0;
  for (const auto& p : pieces) covered += p.length;
  EXPECT_EQ(covered, 12u + 3 * kPieceBytes + 5);
  auto data = RandomBytes(total, 3);
  ParallelRunner one(1), four(4);
  EXPECT_EQ(ChecksumOfRegion(t, data.data(), &one), ChecksumOfRegion(t, data.data(), &four));
  const uint64_t before = ChecksumOfRegion(t, data.data(), &four);
  data[t[2].offset + 2 * kPieceBytes + 1] ^= 1;
  EXPECT_NE(before, ChecksumOfRegion(t, data.data(), &four));
}

TEST(Parallel, RunsEveryIndexExactlyOnceAcrossManyRuns) {
  ParallelRunner runner(3);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::atomic<int>> hits(37);
    runner.Run(hits.size(), [&](size_t i) { hits[i]++; });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(Manifest, RoundTripKeepsEveryField) {
  Manifest m;
  m.job = "job-1";
  m.seq = 17;
  m.step = -3;
  m.wall_time = 1234.5;
  m.scope = "rank2";
  m.tensors = {{"model/w", "float32", {2, 3}, 0, 24}, {"kw/x", "int64", {}, 64, 8}};
  m.data_bytes = 128;
  m.meta_json = R"({"kwargs":{"epoch":10}})";
  auto parsed = Manifest::Parse(m.Serialize());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->job, "job-1");
  EXPECT_EQ(parsed->seq, 17u);
  EXPECT_EQ(parsed->step, -3);
  EXPECT_EQ(parsed->scope, "rank2");
  EXPECT_DOUBLE_EQ(parsed->wall_time, 1234.5);
  ASSERT_EQ(parsed->tensors.size(), 2u);
  EXPECT_EQ(parsed->tensors[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(parsed->tensors[1].offset, 64u);
  EXPECT_EQ(parsed->meta_json, R"({"kwargs":{"epoch":10}})");
  EXPECT_TRUE(parsed->Validate().ok());
}

TEST(Manifest, RejectsGarbageOverlapsAndOutOfRangeTensors) {
  EXPECT_EQ(Manifest::Parse("not json").status().code(), Status::Code::kCorruption);
  EXPECT_EQ(Manifest::Parse(R"({"format":"other"})").status().code(), Status::Code::kCorruption);
  EXPECT_EQ(Manifest::Parse(R"({"format":"efdl-snapshot/1","job":"j"})").status().code(),
            Status::Code::kCorruption);
  Manifest m;
  m.data_bytes = 100;
  m.tensors = {{"a", "uint8", {64}, 0, 64}, {"b", "uint8", {64}, 32, 64}};
  EXPECT_EQ(m.Validate().code(), Status::Code::kCorruption);
  m.tensors = {{"a", "uint8", {64}, 64, 64}};
  EXPECT_EQ(m.Validate().code(), Status::Code::kCorruption);
}

}  // namespace
}  // namespace efdl::snapshot
