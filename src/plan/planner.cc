#include "plan/planner.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <map>
#include <numeric>
#include <set>

#include <fmt/format.h>

namespace efdl::plan {

namespace {

// Evaluated candidates before the search gives up proving optimality.
constexpr uint64_t kSearchBudget = 2'000'000;
constexpr int kMaxFree = 1'000'000;

// Hosts with the same free count are interchangeable for rules 1 and 2, so the search picks how
// many hosts of each free count to use, not which ones.
struct Group {
  int value = 0;
  std::vector<size_t> hosts;  // input positions, ascending
};

// Compares two leftover histograms as sorted-descending lists: more hosts at a higher free
// count is the lexicographically larger list. Returns <0, 0, >0.
int CompareLeftover(const std::vector<int>& a, const std::vector<int>& b) {
  for (size_t v = a.size(); v-- > 0;) {
    if (a[v] != b[v]) return a[v] > b[v] ? 1 : -1;
  }
  return 0;
}

class Search {
 public:
  Search(int procs, int parts, std::vector<Group> groups)
      : procs_(procs), parts_(parts), groups_(std::move(groups)) {
    max_value_ = groups_.empty() ? 0 : groups_[0].value;
    suffix_hosts_.assign(groups_.size() + 1, 0);
    for (size_t j = groups_.size(); j-- > 0;) {
      suffix_hosts_[j] = suffix_hosts_[j + 1] + groups_[j].hosts.size();
    }
    take_.assign(groups_.size(), 0);
  }

  void Run() { Dfs(0, parts_, 0); }
  bool found() const { return !best_take_.empty(); }
  bool exhausted() const { return evaluated_ >= kSearchBudget; }
  const std::vector<int>& best_take() const { return best_take_; }

 private:
  // The largest sum `picks` hosts from groups j.. can give.
  int64_t MaxSum(size_t j, int picks) const {
    int64_t sum = 0;
    for (; j < groups_.size() && picks > 0; ++j) {
      int t = std::min<int>(picks, static_cast<int>(groups_[j].hosts.size()));
      sum += static_cast<int64_t>(t) * groups_[j].value;
      picks -= t;
    }
    return picks > 0 ? -1 : sum;
  }

  void Dfs(size_t j, int picks, int64_t sum) {
    if (exhausted()) return;
    if (j == groups_.size()) {
      if (picks == 0 && sum >= procs_) Evaluate(sum);
      return;
    }
    int hi = std::min<int>(picks, static_cast<int>(groups_[j].hosts.size()));
    int lo = std::max<int>(0, picks - static_cast<int>(suffix_hosts_[j + 1]));
    for (int t = lo; t <= hi; ++t) {
      int64_t rest = MaxSum(j + 1, picks - t);
      if (rest < 0 || sum + static_cast<int64_t>(t) * groups_[j].value + rest < procs_) continue;
      take_[j] = t;
      Dfs(j + 1, picks - t, sum + static_cast<int64_t>(t) * groups_[j].value);
      // Hosts of the largest free count can never end up with that many free once used, so
      // the leftover list's first entry is decided by how many of them stay untouched: the
      // fewest that works is strictly best.
      if (j == 0) break;
    }
    take_[j] = 0;
  }

  // Leftover free counts of all hosts as a histogram (index = free count): hosts not taken
  // keep theirs; the surplus inside the taken hosts is packed onto as few of them as possible,
  // largest first, which is the lexicographically best leftover for this choice of hosts.
  std::vector<int> Leftover(int64_t sum) const {
    std::vector<int> hist(static_cast<size_t>(max_value_) + 1, 0);
    int64_t surplus = sum - procs_;
    for (size_t j = 0; j < groups_.size(); ++j) {
      const auto& g = groups_[j];
      hist[static_cast<size_t>(g.value)] += static_cast<int>(g.hosts.size()) - take_[j];
      for (int i = 0; i < take_[j]; ++i) {
        int64_t a = std::min<int64_t>(surplus, g.value - 1);
        surplus -= a;
        ++hist[static_cast<size_t>(a)];
      }
    }
    return hist;
  }

  std::vector<size_t> Positions() const {
    std::vector<size_t> pos;
    for (size_t j = 0; j < groups_.size(); ++j) {
      pos.insert(pos.end(), groups_[j].hosts.begin(), groups_[j].hosts.begin() + take_[j]);
    }
    std::sort(pos.begin(), pos.end());
    return pos;
  }

  void Evaluate(int64_t sum) {
    ++evaluated_;
    std::vector<int> hist = Leftover(sum);
    bool better = best_take_.empty();
    if (!better) {
      int c = CompareLeftover(hist, best_hist_);
      better = c > 0 || (c == 0 && Positions() < best_pos_);
    }
    if (better) {
      best_take_ = take_;
      best_hist_ = std::move(hist);
      best_pos_ = Positions();
    }
  }

  const int procs_;
  const int parts_;
  const std::vector<Group> groups_;
  int max_value_ = 0;
  std::vector<size_t> suffix_hosts_;
  std::vector<int> take_;
  uint64_t evaluated_ = 0;
  std::vector<int> best_take_;
  std::vector<int> best_hist_;
  std::vector<size_t> best_pos_;
};

// Whether leftovers `values` can go to hosts with `caps` (each value <= its host's cap, one per
// host): true iff, both sorted descending, every value fits the cap at its position.
bool Assignable(std::vector<int> values, std::vector<int> caps) {
  std::sort(values.rbegin(), values.rend());
  std::sort(caps.rbegin(), caps.rend());
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] > caps[i]) return false;
  }
  return true;
}

std::string JoinParts(const std::vector<const HostFree*>& hosts) {
  std::string out;
  for (const auto* h : hosts) {
    if (!out.empty()) out += " + ";
    out += fmt::format("{} {}", h->host, h->free);
  }
  return out;
}

}  // namespace

Result<std::vector<HostFree>> ParseFreeList(std::string_view text) {
  if (text.empty()) {
    return Status::InvalidArgument("--free is empty: list free GPUs per host as host1:3,host2:6");
  }
  std::vector<HostFree> out;
  std::set<std::string> seen;
  size_t pos = 0;
  while (true) {
    size_t comma = text.find(',', pos);
    std::string_view item = text.substr(pos, comma == std::string_view::npos ? text.npos
                                                                             : comma - pos);
    if (item.empty()) {
      return Status::InvalidArgument(fmt::format(
          "--free '{}' has an empty entry: list free GPUs per host as host1:3,host2:6", text));
    }
    size_t colon = item.rfind(':');
    if (colon == std::string_view::npos) {
      return Status::InvalidArgument(fmt::format(
          "--free entry '{}' has no ':': write host:free_gpus, e.g. host1:3", item));
    }
    std::string_view host = item.substr(0, colon);
    std::string_view count = item.substr(colon + 1);
    if (host.empty()) {
      return Status::InvalidArgument(fmt::format(
          "--free entry '{}' has no host name: write host:free_gpus, e.g. host1:3", item));
    }
    if (host.find(':') != std::string_view::npos &&
        !(host.size() > 2 && host.front() == '[' && host.back() == ']')) {
      return Status::InvalidArgument(fmt::format(
          "--free entry '{}' has more than one ':': write host:free_gpus, with IPv6 addresses "
          "in brackets, e.g. [fd00::1]:4",
          item));
    }
    int free = -1;
    auto [end, ec] = std::from_chars(count.data(), count.data() + count.size(), free);
    if (count.empty() || ec != std::errc() || end != count.data() + count.size() || free < 0 ||
        free > kMaxFree) {
      return Status::InvalidArgument(fmt::format(
          "--free entry '{}': '{}' is not a free GPU count (a whole number from 0 to {})", item,
          count, kMaxFree));
    }
    if (!seen.insert(std::string(host)).second) {
      return Status::InvalidArgument(fmt::format(
          "--free lists host '{}' twice: give each host once with its total free GPUs", host));
    }
    out.push_back({std::string(host), free});
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

Result<Placement> PlanPlacement(const PlanRequest& request) {
  if (request.procs < 1) {
    return Status::InvalidArgument(fmt::format(
        "the job needs at least 1 process (got {}): pass --procs N with N >= 1", request.procs));
  }
  if (request.max_parts < 0) {
    return Status::InvalidArgument(fmt::format(
        "--max-parts must be at least 1 (got {}); leave it out for no limit", request.max_parts));
  }
  if (request.hosts.empty()) {
    return Status::InvalidArgument("no hosts given: list free GPUs per host as host1:3,host2:6");
  }
  std::set<std::string> seen;
  for (const auto& h : request.hosts) {
    if (h.host.empty()) return Status::InvalidArgument("a host has an empty name");
    if (!seen.insert(h.host).second) {
      return Status::InvalidArgument(fmt::format(
          "host '{}' is listed twice: give each host once with its total free GPUs", h.host));
    }
    if (h.free < 0 || h.free > kMaxFree) {
      return Status::InvalidArgument(fmt::format(
          "host '{}' has {} free GPUs: use a whole number from 0 to {}", h.host, h.free,
          kMaxFree));
    }
  }

  // Rule 1: the fewest parts is the smallest k whose k largest hosts hold enough.
  std::vector<const HostFree*> by_free;
  for (const auto& h : request.hosts) {
    if (h.free > 0) by_free.push_back(&h);
  }
  std::stable_sort(by_free.begin(), by_free.end(),
                   [](const HostFree* a, const HostFree* b) { return a->free > b->free; });
  int64_t total = 0;
  int parts = 0;
  for (const auto* h : by_free) {
    total += h->free;
    ++parts;
    if (total >= request.procs) break;
  }
  if (total < request.procs) {
    return Status::FailedPrecondition(fmt::format(
        "no placement: need {} processes, but all {} hosts together have only {} free GPUs",
        request.procs, request.hosts.size(), total));
  }
  if (request.max_parts > 0 && parts > request.max_parts) {
    std::vector<const HostFree*> top(by_free.begin(), by_free.begin() + request.max_parts);
    int64_t best = 0;
    for (const auto* h : top) best += h->free;
    return Status::FailedPrecondition(fmt::format(
        "no placement: need {} processes in at most {} part{}, but the {} host{} with the most "
        "free GPUs give{} only {} ({}); {} parts would be needed",
        request.procs, request.max_parts, request.max_parts == 1 ? "" : "s", request.max_parts,
        request.max_parts == 1 ? "" : "s", request.max_parts == 1 ? "s" : "", best,
        JoinParts(top), parts));
  }

  // Rules 2 and 3 over which hosts (by free count) to use.
  std::map<int, std::vector<size_t>, std::greater<>> grouped;
  for (size_t i = 0; i < request.hosts.size(); ++i) {
    if (request.hosts[i].free > 0) grouped[request.hosts[i].free].push_back(i);
  }
  std::vector<Group> groups;
  for (auto& [value, hosts] : grouped) groups.push_back({value, std::move(hosts)});
  Search search(request.procs, parts, groups);
  search.Run();
  if (!search.found()) {
    return Status::Internal("fragment planner found no placement although one exists");
  }

  // The chosen hosts and the leftover each keeps: the surplus packed onto as few hosts as
  // possible, largest free first (as in the search), then handed to hosts so that earlier
  // hosts keep less, i.e. run more processes (rule 3).
  std::vector<size_t> chosen;
  std::vector<int> caps_desc;
  for (size_t j = 0; j < groups.size(); ++j) {
    for (int i = 0; i < search.best_take()[j]; ++i) {
      chosen.push_back(groups[j].hosts[static_cast<size_t>(i)]);
      caps_desc.push_back(groups[j].value - 1);
    }
  }
  int64_t surplus = -request.procs;
  for (size_t idx : chosen) surplus += request.hosts[idx].free;
  std::vector<int> values;
  for (int cap : caps_desc) {
    int a = static_cast<int>(std::min<int64_t>(surplus, cap));
    surplus -= a;
    values.push_back(a);
  }
  std::sort(chosen.begin(), chosen.end());
  std::vector<int> left_of(request.hosts.size(), -1);
  for (size_t n = 0; n < chosen.size(); ++n) {
    size_t idx = chosen[n];
    int cap = request.hosts[idx].free - 1;
    std::vector<int> distinct(values.begin(), values.end());
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    for (int v : distinct) {
      if (v > cap) break;
      std::vector<int> rest_values = values;
      rest_values.erase(std::find(rest_values.begin(), rest_values.end(), v));
      std::vector<int> rest_caps;
      for (size_t m = n + 1; m < chosen.size(); ++m) {
        rest_caps.push_back(request.hosts[chosen[m]].free - 1);
      }
      if (Assignable(rest_values, rest_caps)) {
        left_of[idx] = v;
        values = std::move(rest_values);
        break;
      }
    }
    if (left_of[idx] < 0) {
      return Status::Internal("fragment planner could not hand out the leftover GPUs");
    }
  }

  Placement out;
  out.procs = request.procs;
  out.proven_best = !search.exhausted();
  for (size_t i = 0; i < request.hosts.size(); ++i) {
    const auto& h = request.hosts[i];
    if (left_of[i] >= 0) {
      out.parts.push_back({h.host, h.free - left_of[i], h.free});
      out.leftover.push_back({h.host, left_of[i]});
    } else {
      out.leftover.push_back(h);
    }
  }
  return out;
}

}  // namespace efdl::plan
