#include "health/straggler_rules.h"

#include <algorithm>

namespace efdl::health {

namespace {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace

std::chrono::milliseconds PublishPeriod(const StragglerPolicy& policy, int nnodes) {
  const std::chrono::milliseconds p = policy.window / kWindowsToName;
  return std::max({p, kMinPeriod, JobRatePeriod(nnodes)});
}

void ComputeWindow::Add(int rank, StragglerClock::time_point now, int64_t compute_ns,
                        int64_t steps) {
  Rank& r = ranks_[rank];
  if (!r.baseline || steps < r.steps || compute_ns < r.compute_ns) {
    r.baseline = true;
    r.compute_ns = compute_ns;
    r.steps = steps;
    return;
  }
  if (steps == r.steps) return;
  const double mean = static_cast<double>(compute_ns - r.compute_ns) * 1e-9 /
                      static_cast<double>(steps - r.steps);
  r.compute_ns = compute_ns;
  r.steps = steps;
  r.samples.emplace_back(now, mean);
  // Nothing older than a generous bound is ever summarised (periods are minutes at most).
  while (!r.samples.empty() && now - r.samples.front().first > std::chrono::hours(1)) {
    r.samples.pop_front();
  }
  while (r.samples.size() > 4096) r.samples.pop_front();
}

std::map<int, double> ComputeWindow::Summary(StragglerClock::time_point now,
                                             std::chrono::milliseconds period) const {
  std::map<int, double> out;
  for (const auto& [rank, r] : ranks_) {
    std::vector<double> within;
    for (const auto& [at, mean] : r.samples) {
      if (at <= now && now - at <= period) within.push_back(mean);
    }
    if (!within.empty()) out[rank] = Median(std::move(within));
  }
  return out;
}

Comparison Compare(const StragglerPolicy& policy, const NodeCompute& node,
                   const std::vector<NodeCompute>& others) {
  Comparison c;
  std::vector<double> reference;
  for (const auto& o : others) {
    if (o.node == node.node || o.round != node.round) continue;
    for (const auto& [rank, s] : o.compute_s) reference.push_back(s);
  }
  if (reference.empty() || node.compute_s.empty() || !policy.enabled()) return c;
  c.judged = true;
  c.detail.node = node.node;
  c.detail.median_s = Median(std::move(reference));
  for (const auto& [rank, s] : node.compute_s) c.detail.compute_s = std::max(c.detail.compute_s, s);
  const double bar = std::max(policy.factor * c.detail.median_s,
                              c.detail.median_s + kMinExcessSeconds);
  for (const auto& [rank, s] : node.compute_s) {
    if (s >= bar) c.detail.ranks.push_back(rank);
  }
  c.slow = !c.detail.ranks.empty();
  return c;
}

StragglerJudge::Verdict StragglerJudge::Judge(int64_t round,
                                              const std::vector<NodeCompute>& latest) {
  Verdict v;
  if (round != round_) {   // a new round: every count starts again
    round_ = round;
    tracks_.clear();
    for (const auto& n : named_) v.cleared.push_back(n);
    named_.clear();
  }
  std::vector<NodeCompute> current;
  for (const auto& n : latest) {
    if (n.round == round) current.push_back(n);
  }
  std::set<std::string> present;
  for (const auto& n : current) {
    present.insert(n.node);
    Track& t = tracks_[n.node];
    if (n.seq == t.seq) continue;   // already counted
    t.seq = n.seq;
    const Comparison c = Compare(policy_, n, current);
    if (!c.judged) continue;        // nothing to compare with: the count stays
    if (c.slow) {
      ++t.streak;
      t.last = c.detail;
    } else {
      t.streak = 0;
    }
  }
  for (auto it = tracks_.begin(); it != tracks_.end();) {
    it = present.count(it->first) ? std::next(it) : tracks_.erase(it);
  }
  std::set<std::string> now;
  for (auto& [node, t] : tracks_) {
    if (t.streak < kWindowsToName) continue;
    t.last.windows = t.streak;
    now.insert(node);
    v.stragglers.push_back(t.last);
    if (!named_.count(node)) v.named.push_back(t.last);
  }
  for (const auto& n : named_) {
    if (!now.count(n)) v.cleared.push_back(n);
  }
  named_ = std::move(now);
  return v;
}

}  // namespace efdl::health
