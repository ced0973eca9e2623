#include "plan/fragment.h"

#include <algorithm>
#include <limits>
#include <map>

#include <fmt/format.h>

namespace efdl::plan {

namespace {
constexpr int kMaxWorldSize = 1'000'000;
constexpr int kUnreachable = std::numeric_limits<int>::max() / 2;
}  // namespace

Result<std::vector<size_t>> ChooseFragmentMembers(const std::vector<int>& nproc_in_join_order,
                                                  int world_size) {
  if (world_size < 1 || world_size > kMaxWorldSize) {
    return Status::InvalidArgument(fmt::format(
        "world size {} is out of range: use 1 to {}", world_size, kMaxWorldSize));
  }
  // Nodes with the same count are interchangeable for rules 1 and 2; within a count the oldest
  // are taken (rule 3). Groups are ordered by count, largest first.
  std::map<int, std::vector<size_t>, std::greater<>> by_count;
  for (size_t i = 0; i < nproc_in_join_order.size(); ++i) {
    int n = nproc_in_join_order[i];
    if (n < 1) {
      return Status::InvalidArgument(fmt::format(
          "registered node #{} has {} processes: every node runs at least one", i, n));
    }
    if (n <= world_size) by_count[n].push_back(i);
  }
  std::vector<std::pair<int, const std::vector<size_t>*>> groups;
  for (const auto& [n, members] : by_count) groups.emplace_back(n, &members);

  // fewest[j][s]: the fewest nodes from groups j.. whose counts add up to exactly s.
  const size_t S = static_cast<size_t>(world_size);
  std::vector<std::vector<int>> fewest(groups.size() + 1, std::vector<int>(S + 1, kUnreachable));
  fewest[groups.size()][0] = 0;
  for (size_t j = groups.size(); j-- > 0;) {
    const auto v = static_cast<size_t>(groups[j].first);
    const size_t have = groups[j].second->size();
    for (size_t s = 0; s <= S; ++s) {
      int best = fewest[j + 1][s];
      for (size_t t = 1; t <= have && t * v <= s; ++t) {
        int rest = fewest[j + 1][s - t * v];
        if (rest != kUnreachable) best = std::min(best, rest + static_cast<int>(t));
      }
      fewest[j][s] = best;
    }
  }
  if (fewest[0][S] == kUnreachable) {
    std::string counts;
    for (int n : nproc_in_join_order) counts += (counts.empty() ? "" : ",") + std::to_string(n);
    return Status::NotFound(fmt::format(
        "no set of the {} registered nodes (processes per node in join order: {}) adds up to "
        "world size {}; waiting for nodes that make it add up",
        nproc_in_join_order.size(), counts.empty() ? "none" : counts, world_size));
  }
  // Walk the groups largest first, taking as many as still allows the fewest-node total:
  // more of a larger count makes the sorted list lexicographically larger (rule 2).
  std::vector<size_t> chosen;
  size_t s = S;
  int left = fewest[0][S];
  for (size_t j = 0; j < groups.size(); ++j) {
    const auto v = static_cast<size_t>(groups[j].first);
    const auto& members = *groups[j].second;
    size_t t = std::min(members.size(), s / v);
    for (;; --t) {
      int rest = fewest[j + 1][s - t * v];
      if (rest != kUnreachable && rest + static_cast<int>(t) == left) break;
      if (t == 0) return Status::Internal("fragment member choice lost its way");
    }
    chosen.insert(chosen.end(), members.begin(), members.begin() + static_cast<long>(t));
    s -= t * v;
    left -= static_cast<int>(t);
  }
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

}  // namespace efdl::plan
