#include "dashboard/throughput.h"

#include <algorithm>
#include <set>

namespace efdl::dashboard {

void ThroughputHistory::Observe(double now, const std::vector<StepReading>& readings,
                                int64_t round, int world_size) {
  std::set<std::pair<std::string, int>> seen;
  std::vector<double> rates;
  double sum = 0;
  for (const StepReading& r : readings) {
    auto key = std::make_pair(r.node, r.rank);
    if (!seen.insert(key).second) continue;  // one reading per rank and poll
    RankTrack& track = ranks_[key];
    if (!track.readings.empty() &&
        (r.step < track.readings.back().second || now <= track.readings.back().first)) {
      track.readings.clear();   // the step went back (or the clock did): start over
    }
    track.readings.emplace_back(now, r.step);
    // Keep the newest reading at least rate_window_s old (and those after it).
    while (track.readings.size() > 2 && now - track.readings[1].first >= rate_window_s_) {
      track.readings.pop_front();
    }
    const auto& [t0, s0] = track.readings.front();
    track.rate = now > t0 ? static_cast<double>(r.step - s0) / (now - t0) : 0.0;
    rates.push_back(track.rate);
    sum += track.rate;
  }
  for (auto it = ranks_.begin(); it != ranks_.end();) {
    it = seen.count(it->first) ? std::next(it) : ranks_.erase(it);
  }
  ThroughputPoint p;
  p.t = now;
  p.rank_steps_per_s = sum;
  p.ranks = static_cast<int>(rates.size());
  if (!rates.empty()) {
    std::sort(rates.begin(), rates.end());
    size_t n = rates.size();
    p.job_steps_per_s = n % 2 ? rates[n / 2] : (rates[n / 2 - 1] + rates[n / 2]) / 2;
  }
  p.round = round;
  p.world_size = world_size;
  points_.push_back(p);
  while (!points_.empty() &&
         (points_.size() > max_points_ || now - points_.front().t > window_s_)) {
    points_.pop_front();
  }
}

std::optional<double> ThroughputHistory::RankRate(const std::string& node, int rank) const {
  auto it = ranks_.find({node, rank});
  if (it == ranks_.end()) return std::nullopt;
  return it->second.rate;
}

}  // namespace efdl::dashboard
