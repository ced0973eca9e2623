#include "plan/fragment.h"

#include <algorithm>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

namespace efdl::plan {
namespace {

std::vector<size_t> Choose(const std::vector<int>& nproc, int world) {
  auto r = ChooseFragmentMembers(nproc, world);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : std::vector<size_t>{999};
}

using V = std::vector<size_t>;

TEST(FragmentMembersTest, ChosenCases) {
  EXPECT_EQ(Choose({1, 2}, 3), (V{0, 1}));            // the e2e layout: 1 + 2
  EXPECT_EQ(Choose({1, 1, 1}, 3), (V{0, 1, 2}));      // the 2-proc node replaced by two 1s
  EXPECT_EQ(Choose({1, 1, 1, 2}, 3), (V{0, 3}));      // fewer nodes beat older ones
  EXPECT_EQ(Choose({2, 2, 1, 3}, 4), (V{2, 3}));      // 3+1 beats 2+2: larger nodes
  EXPECT_EQ(Choose({4, 4, 4}, 8), (V{0, 1}));         // oldest among equals
  EXPECT_EQ(Choose({3, 5, 4, 4, 8}, 8), (V{4}));      // one node that fits exactly
  EXPECT_EQ(Choose({3, 5, 4, 4}, 8), (V{0, 1}));      // 5+3 beats 4+4
  EXPECT_EQ(Choose({6, 2, 2, 2, 2}, 8), (V{0, 1}));
  EXPECT_EQ(Choose({9, 2, 6}, 8), (V{1, 2}));         // a node larger than N never fits
  EXPECT_EQ(Choose({1}, 1), (V{0}));
}

TEST(FragmentMembersTest, NoSubsetIsReported) {
  auto r = ChooseFragmentMembers({2, 2, 4}, 5);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.status().IsNotFound());
  EXPECT_EQ(r.status().message(),
            "no set of the 3 registered nodes (processes per node in join order: 2,2,4) adds up "
            "to world size 5; waiting for nodes that make it add up");
  EXPECT_TRUE(ChooseFragmentMembers({}, 2).status().IsNotFound());
  EXPECT_FALSE(ChooseFragmentMembers({1, 1}, 3).ok());
}

TEST(FragmentMembersTest, BadInputIsInvalidArgument) {
  EXPECT_EQ(ChooseFragmentMembers({1}, 0).status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(ChooseFragmentMembers({1, 0}, 1).status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(ChooseFragmentMembers({1}, 2'000'000).status().code(),
            Status::Code::kInvalidArgument);
}

// Reference: every subset, ranked by (fewer nodes, larger sorted counts, older sorted indices).
std::optional<V> BruteForce(const std::vector<int>& nproc, int world) {
  std::optional<V> best;
  std::tuple<size_t, std::vector<int>, V> best_key;
  for (uint32_t mask = 1; mask < (1u << nproc.size()); ++mask) {
    int sum = 0;
    V members;
    std::vector<int> neg_counts;
    for (size_t i = 0; i < nproc.size(); ++i) {
      if (mask & (1u << i)) {
        sum += nproc[i];
        members.push_back(i);
        neg_counts.push_back(-nproc[i]);
      }
    }
    if (sum != world) continue;
    std::sort(neg_counts.begin(), neg_counts.end());
    auto key = std::tuple(members.size(), neg_counts, members);
    if (!best || key < best_key) {
      best = members;
      best_key = key;
    }
  }
  return best;
}

TEST(FragmentMembersTest, MatchesBruteForceOnRandomSmallInputs) {
  std::mt19937 rng(42);
  int found = 0, none = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<int> nproc(rng() % 11);
    for (auto& n : nproc) n = 1 + static_cast<int>(rng() % 5);
    int world = 1 + static_cast<int>(rng() % 14);
    auto want = BruteForce(nproc, world);
    auto got = ChooseFragmentMembers(nproc, world);
    std::string input = fmt::format("nproc [{}] world {}", fmt::join(nproc, ","), world);
    if (!want) {
      EXPECT_TRUE(got.status().IsNotFound()) << input;
      ++none;
    } else {
      ASSERT_TRUE(got.ok()) << input << ": " << got.status().ToString();
      EXPECT_EQ(*got, *want) << input;
      ++found;
    }
  }
  EXPECT_GT(found, 1000);
  EXPECT_GT(none, 100);
}

TEST(FragmentMembersTest, ManyNodesAreFast) {
  std::vector<int> nproc;
  for (int i = 0; i < 3000; ++i) nproc.push_back(1 + i % 8);
  auto r = ChooseFragmentMembers(nproc, 4099);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  int sum = 0;
  for (size_t i : *r) sum += nproc[i];
  EXPECT_EQ(sum, 4099);
  EXPECT_EQ(r->size(), 532u);  // all 375 nodes of 8 give 3000, then 157 nodes of 7 give 1099
}

}  // namespace
}  // namespace efdl::plan
