#include "plan/planner.h"

#include <algorithm>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

namespace efdl::plan {
namespace {

std::vector<HostFree> Hosts(std::string_view text) {
  auto h = ParseFreeList(text);
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  return h.ok() ? *h : std::vector<HostFree>{};
}

// "host2:6,host3:2" for the parts of a placement.
std::string Describe(const Placement& p) {
  std::string out;
  for (const auto& part : p.parts) {
    out += fmt::format("{}{}:{}", out.empty() ? "" : ",", part.host, part.procs);
  }
  return out;
}

std::string PlanOf(int procs, std::string_view free, int max_parts = 0) {
  auto p = PlanPlacement({procs, Hosts(free), max_parts});
  return p.ok() ? Describe(*p) : "error: " + p.status().message();
}

TEST(FragmentPlannerTest, IssueExampleUsesThreePlusFive) {
  auto p = PlanPlacement({8, Hosts("host1:3,host2:6,host3:5"), 2});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(Describe(*p), "host1:3,host3:5");
  EXPECT_TRUE(p->proven_best);
  ASSERT_EQ(p->leftover.size(), 3u);
  EXPECT_EQ(p->leftover[0].free, 0);
  EXPECT_EQ(p->leftover[1].free, 6);
  EXPECT_EQ(p->leftover[2].free, 0);
  EXPECT_EQ(p->parts[0].free, 3);
}

TEST(FragmentPlannerTest, ChosenCases) {
  // One host that fits: the smallest that fits (best fit), exact fill preferred.
  EXPECT_EQ(PlanOf(4, "a:8,b:3,c:5"), "c:4");
  EXPECT_EQ(PlanOf(5, "a:6,b:5"), "b:5");
  EXPECT_EQ(PlanOf(8, "a:8,b:8"), "a:8");                  // tie: first listed
  EXPECT_EQ(PlanOf(3, "a:4,b:4,c:4"), "a:3");
  // Two parts needed: exact pairs beat splitting a big host.
  EXPECT_EQ(PlanOf(10, "a:8,b:8,c:5,d:5"), "c:5,d:5");
  EXPECT_EQ(PlanOf(7, "a:3,b:4,c:6,d:2"), "a:3,b:4");
  // A big host must be used: keep the surplus on one host, as one block.
  EXPECT_EQ(PlanOf(9, "a:8,b:2,c:2"), "a:8,b:1");
  EXPECT_EQ(PlanOf(9, "a:8,b:3"), "a:8,b:1");  // a:6,b:3 leaves the same 2: fill a first
  // Three parts.
  EXPECT_EQ(PlanOf(8, "a:3,b:3,c:3,d:1"), "a:3,b:3,c:2");
  EXPECT_EQ(PlanOf(6, "a:2,b:2,c:2,d:2"), "a:2,b:2,c:2");
  // Hosts with nothing free are never used and do not count as parts.
  EXPECT_EQ(PlanOf(2, "a:0,b:2"), "b:2");
  // A limit that is enough changes nothing.
  EXPECT_EQ(PlanOf(8, "host1:3,host2:6,host3:5", 3), "host1:3,host3:5");
}

TEST(FragmentPlannerTest, NoPlacementSaysHowCloseItGets) {
  auto p = PlanPlacement({8, Hosts("host1:3,host2:4"), 0});
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(p.status().IsFailedPrecondition());
  EXPECT_EQ(p.status().message(),
            "no placement: need 8 processes, but all 2 hosts together have only 7 free GPUs");
  p = PlanPlacement({8, Hosts("a:3,b:4,c:2,d:1"), 2});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().message(),
            "no placement: need 8 processes in at most 2 parts, but the 2 hosts with the most "
            "free GPUs give only 7 (b 4 + a 3); 3 parts would be needed");
  p = PlanPlacement({5, Hosts("a:4,b:3"), 1});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("at most 1 part, but the 1 host with the most free GPUs "
                                      "gives only 4 (a 4)"),
            std::string::npos)
      << p.status().message();
}

TEST(FragmentPlannerTest, BadInputIsRejectedWithOneLine) {
  EXPECT_TRUE(PlanPlacement({0, Hosts("a:1"), 0}).status().code() ==
              Status::Code::kInvalidArgument);
  EXPECT_FALSE(PlanPlacement({1, {}, 0}).ok());
  EXPECT_FALSE(PlanPlacement({1, {{"a", 1}, {"a", 2}}, 0}).ok());
  EXPECT_FALSE(PlanPlacement({1, {{"a", -1}}, 0}).ok());
  EXPECT_FALSE(PlanPlacement({1, {{"a", 1}}, -1}).ok());
  for (std::string_view bad : {"", "a", "a:", ":3", "a:x", "a:-1", "a:3,", ",a:3", "a:3,,b:2",
                               "a:3,a:2", "a:1.5", "a:99999999999", "a:3 ", "a:3:4", "fd00::1:4"}) {
    auto r = ParseFreeList(bad);
    EXPECT_FALSE(r.ok()) << "'" << bad << "' was accepted";
    if (!r.ok()) {
      EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
      EXPECT_NE(r.status().message().find("--free"), std::string::npos) << r.status().message();
    }
  }
  auto dup = ParseFreeList("host1:3,host2:1,host1:2");
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("'host1' twice"), std::string::npos);
  auto ok = ParseFreeList("10.0.0.1:3,h-2:0,[fd00::1]:4");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ((*ok)[0].host, "10.0.0.1");
  EXPECT_EQ((*ok)[1].free, 0);
  EXPECT_EQ((*ok)[2].host, "[fd00::1]");
}

// The brute-force reference: every assignment of counts to hosts, ranked by the rules in
// planner.h (fewest parts, lexicographically largest sorted leftover, earliest host set, more
// on earlier hosts).
std::optional<std::vector<int>> BruteForce(int procs, const std::vector<int>& free,
                                           int max_parts) {
  std::optional<std::vector<int>> best;
  std::tuple<int, std::vector<int>, std::vector<size_t>, std::vector<int>> best_key;
  std::vector<int> c(free.size(), 0);
  while (true) {
    int sum = 0, parts = 0;
    for (int x : c) {
      sum += x;
      parts += x > 0;
    }
    if (sum == procs && (max_parts == 0 || parts <= max_parts)) {
      std::vector<int> left;
      std::vector<size_t> pos;
      for (size_t i = 0; i < c.size(); ++i) {
        left.push_back(free[i] - c[i]);
        if (c[i] > 0) pos.push_back(i);
      }
      std::sort(left.rbegin(), left.rend());
      // Smaller key is better: negate what should be large.
      std::vector<int> neg_left, neg_c;
      for (int x : left) neg_left.push_back(-x);
      for (int x : c) neg_c.push_back(-x);
      auto key = std::tuple(parts, neg_left, pos, neg_c);
      if (!best || key < best_key) {
        best = c;
        best_key = key;
      }
    }
    size_t i = 0;
    while (i < c.size() && c[i] == free[i]) c[i++] = 0;
    if (i == c.size()) break;
    ++c[i];
  }
  return best;
}

TEST(FragmentPlannerTest, MatchesBruteForceOnRandomSmallInputs) {
  std::mt19937 rng(20261202);
  int compared = 0, none = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    int n = 1 + static_cast<int>(rng() % 6);
    std::vector<int> free;
    std::vector<HostFree> hosts;
    for (int i = 0; i < n; ++i) {
      free.push_back(static_cast<int>(rng() % 7));
      hosts.push_back({fmt::format("h{}", i), free.back()});
    }
    int procs = 1 + static_cast<int>(rng() % 16);
    int max_parts = static_cast<int>(rng() % 4);
    auto want = BruteForce(procs, free, max_parts);
    auto got = PlanPlacement({procs, hosts, max_parts});
    std::string input = fmt::format("procs {} max_parts {} free {}", procs, max_parts,
                                    fmt::join(free, ","));
    if (!want) {
      EXPECT_FALSE(got.ok()) << input << " -> " << Describe(*got);
      if (!got.ok()) {
        EXPECT_TRUE(got.status().IsFailedPrecondition()) << input;
      }
      ++none;
      continue;
    }
    ASSERT_TRUE(got.ok()) << input << ": " << got.status().ToString();
    std::vector<int> counts(free.size(), 0);
    for (const auto& part : got->parts) counts[std::stoul(part.host.substr(1))] = part.procs;
    EXPECT_EQ(counts, *want) << input;
    EXPECT_TRUE(got->proven_best);
    ++compared;
  }
  EXPECT_GT(compared, 1500);
  EXPECT_GT(none, 200);
}

TEST(FragmentPlannerTest, LargeClusterIsFastAndValid) {
  // 2,000 hosts with 0..8 free, a 300-process job: must answer quickly with a valid placement.
  std::mt19937 rng(5);
  std::vector<HostFree> hosts;
  for (int i = 0; i < 2000; ++i) hosts.push_back({fmt::format("n{}", i), static_cast<int>(rng() % 9)});
  auto start = std::chrono::steady_clock::now();
  auto p = PlanPlacement({300, hosts, 0});
  auto took = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  int sum = 0;
  for (const auto& part : p->parts) {
    EXPECT_GE(part.procs, 1);
    EXPECT_LE(part.procs, part.free);
    sum += part.procs;
  }
  EXPECT_EQ(sum, 300);
  EXPECT_EQ(p->parts.size(), 38u);  // 37 full 8-GPU hosts give 296: one more part is needed
  EXPECT_LT(took, std::chrono::seconds(20));
}

}  // namespace
}  // namespace efdl::plan
