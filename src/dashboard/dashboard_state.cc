#include "dashboard/dashboard_state.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>

namespace efdl::dashboard {

using nlohmann::json;

std::optional<double> ParseIsoTime(const std::string& text) {
  std::tm tm{};
  int ms = 0;
  char z = 0;
  int n = std::sscanf(text.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d.%3d%c", &tm.tm_year, &tm.tm_mon,
                      &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms, &z);
  if (n != 8 || z != 'Z') {
    ms = 0;
    n = std::sscanf(text.c_str(), "%4d-%2d-%2dT%2d:%2d:%2d%c", &tm.tm_year, &tm.tm_mon,
                    &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &z);
    if (n != 7 || z != 'Z') return std::nullopt;
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  std::time_t secs = timegm(&tm);
  if (secs == static_cast<std::time_t>(-1)) return std::nullopt;
  return static_cast<double>(secs) + ms / 1000.0;
}

std::string FormatIsoTime(double t) {
  const int64_t total_ms = static_cast<int64_t>(std::llround(t * 1000));
  std::time_t secs = static_cast<std::time_t>(total_ms / 1000);
  int ms = static_cast<int>(total_ms % 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

DashboardState::DashboardState(std::string job_id, std::string etcd)
    : job_id_(std::move(job_id)), etcd_(std::move(etcd)) {}

void DashboardState::AddEvent(TimelineEvent e) {
  for (const TimelineEvent& have : events_) {
    if (have.kind == e.kind && have.time == e.time && have.message == e.message) return;
  }
  auto at = std::upper_bound(events_.begin(), events_.end(), e.t,
                             [](double t, const TimelineEvent& x) { return t < x.t; });
  events_.insert(at, std::move(e));
  while (events_.size() > kMaxEvents) events_.pop_front();
}

void DashboardState::Update(double now, const Result<rdzv::JobStatus>& status,
                            const std::vector<NodeScrape>& scrapes) {
  now_ = now;
  ++polls_;
  scrapes_ = scrapes;
  if (!status.ok()) {
    etcd_error_ = status.status().message();
  } else {
    etcd_error_.clear();
    status_ = *status;
    for (const rdzv::JobEvent& e : status->events) {
      AddEvent({ParseIsoTime(e.time).value_or(now), e.time, "event", e.message});
    }
    if (status->exists) {
      std::string key, what;
      if (status->suspended) {
        key = fmt::format("{}:suspended", status->round);
        what = fmt::format("round {}: suspended", status->round);
      } else if (status->complete) {
        key = fmt::format("{}:complete", status->round);
        what = fmt::format("round {}: complete", status->round);
      } else if (status->phase == "active") {
        key = fmt::format("{}:active:{}", status->round, status->world_size);
        what = fmt::format("round {}: world size {}", status->round, status->world_size);
      }
      // The round the dashboard found at its first poll is no change; later ones are.
      if (!key.empty() && key != drawn_round_) {
        if (!drawn_round_.empty()) AddEvent({now, FormatIsoTime(now), "round", what});
        drawn_round_ = key;
      }
    }
  }
  std::vector<StepReading> readings;
  for (const NodeScrape& s : scrapes_) {
    if (!s.ok) continue;
    for (const RankStep& r : s.metrics.ranks) readings.push_back({s.node, r.rank, r.step});
  }
  const bool live = status_ && status_->exists && !status_->complete && !status_->suspended;
  throughput_.Observe(now, readings, status_ ? status_->round : 0,
                      live ? status_->world_size : 0);
}

void DashboardState::UpdateLedger(const Result<rdzv::LedgerReport>& ledger) {
  if (!ledger.ok()) {
    ledger_error_ = ledger.status().message();
    return;
  }
  ledger_error_.clear();
  ledger_ = *ledger;
}

std::string DashboardState::ToJson() const {
  json j = {{"job", job_id_}, {"etcd", etcd_}, {"now", now_}, {"polls", polls_},
            {"etcd_error", etcd_error_}};
  // The status object is `efdl status --json`'s own (one owner of its fields).
  j["status"] = status_ ? json::parse(status_->ToJson(), nullptr, false) : json(nullptr);
  json scrapes = json::object();
  for (const NodeScrape& s : scrapes_) {
    json ranks = json::array();
    for (const RankStep& r : s.metrics.ranks) {
      auto rate = throughput_.RankRate(s.node, r.rank);
      ranks.push_back({{"rank", r.rank}, {"step", r.step},
                       {"steps_per_s", rate ? json(*rate) : json(nullptr)}});
    }
    scrapes[s.node] = {{"target", s.target}, {"ok", s.ok}, {"error", s.error},
                       {"ranks", ranks}};
  }
  j["scrapes"] = scrapes;
  json points = json::array();
  for (const ThroughputPoint& p : throughput_.points()) {
    points.push_back({p.t, p.rank_steps_per_s, p.job_steps_per_s, p.ranks, p.round,
                      p.world_size});
  }
  j["throughput"] = points;
  json events = json::array();
  for (const TimelineEvent& e : events_) {
    events.push_back({{"t", e.t}, {"time", e.time}, {"kind", e.kind}, {"message", e.message}});
  }
  j["events"] = events;
  // The ledger object is `efdl events --json`'s own (one owner of its fields).
  j["ledger"] = ledger_ ? json::parse(ledger_->ToJson(), nullptr, false) : json(nullptr);
  j["ledger_error"] = ledger_error_;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace efdl::dashboard
