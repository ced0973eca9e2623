#include <gtest/gtest.h>

#include <numeric>
#include <random>
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

TEST(Hash, CopyAndHashCopiesAndAgreesWithHashForEverySize) {
  for (size_t n : {0, 1, 7, 8, 31, 32, 33, 100, 4095, 4096, 4097, 100000, (1 << 20) + 13}) {
    auto src = RandomBytes(n, static_cast<uint32_t>(n));
    std::vector<uint8_t> dst(n + 1, 0xAB);
    uint64_t h = CopyAndHash64(dst.data(), src.data(), n, 42);
    EXPECT_EQ(h, Hash64(src.data(), n, 42)) << n;
    EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin())) << n;
    EXPECT_EQ(dst[n], 0xAB) << "wrote past the end at n=" << n;
  }
}

// The checksum's definition written out plainly (hash.h): every implementation of Hash64 (the
// vector one included) must give exactly these values, or stored snapshots stop verifying.
uint64_t ReferenceHash64(const uint8_t* p, size_t n, uint64_t seed) {
  constexpr uint64_t m1 = 0x9E3779B97F4A7C15ULL, m2 = 0xD6E8FEB86659FD93ULL,
                     m3 = 0xFF51AFD7ED558CCDULL;
  auto rotl = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
  auto load = [](const uint8_t* q) {
    uint64_t v = 0;
    for (int b = 7; b >= 0; --b) v = (v << 8) | q[b];  // little-endian, as the x86 loads
    return v;
  };
  auto lane = [&](uint64_t acc, uint64_t v) { return rotl(acc ^ (v * m2), 27) * m1; };
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
  h ^= h >> 32;
  h *= m3;
  h ^= h >> 29;
  h *= m2;
  h ^= h >> 32;
  return h;
}

TEST(Hash, EveryImplementationMatchesTheDefinition) {
  for (size_t n : {0, 5, 31, 32, 255, 256, 257, 1000, 4096 + 17, (1 << 20) + 13}) {
    auto data = RandomBytes(n, static_cast<uint32_t>(n) + 3);
    const uint64_t want = ReferenceHash64(data.data(), n, 77);
    EXPECT_EQ(Hash64(data.data(), n, 77), want) << n;
    std::vector<uint8_t> dst(n);
    EXPECT_EQ(CopyAndHash64(dst.data(), data.data(), n, 77), want) << n;
    // In parts, as a restore hashes what it just read.
    Hasher64 parts(77);
    size_t whole = n & ~size_t{31}, i = 0;
    for (size_t step = 64; i < whole; step *= 2) {
      size_t len = std::min(step, whole - i);
      parts.Update(data.data() + i, len);
      i += len;
    }
    EXPECT_EQ(parts.Finish(data.data() + whole, n - whole, n), want) << n;
  }
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
