#include "agent/straggler_watch.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <ctime>

#include "common/log.h"
#include "health/exclusion_rules.h"

namespace efdl::agent {

namespace {

// ISO-8601 UTC to the second, `after` from now (as the exclusion records).
std::string IsoIn(std::chrono::milliseconds after) {
  const std::time_t t = std::chrono::system_clock::to_time_t(
      std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::seconds>(after));
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string IsoNow() { return IsoIn(std::chrono::milliseconds(0)); }

std::string RanksText(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

double Secs(std::chrono::milliseconds ms) { return static_cast<double>(ms.count()) / 1000.0; }

}  // namespace

bool StragglerWatch::SampleDue(std::chrono::steady_clock::time_point now) {
  if (!config_.policy.enabled() || now < next_compute_sample_) return false;
  next_compute_sample_ = now + std::chrono::seconds(1);
  return true;
}

void StragglerWatch::WarnRead(const Status& status) {
  if (straggler_read_warned_) return;
  straggler_read_warned_ = true;
  EFDL_LOG_WARN("stragglers: {}", status.message());
}

std::optional<StragglerWatch::Eviction> StragglerWatch::Sample(
    std::chrono::steady_clock::time_point now, const rdzv::Assignment& round,
    const std::vector<health::HangMonitor::RankSample>& reports) {
  const health::StragglerPolicy& policy = config_.policy;
  metrics::AgentMetrics* const metrics = config_.metrics;
  const std::chrono::milliseconds period = health::PublishPeriod(policy, round.nnodes);
  if (compute_round_ != round.round) {
    // A new round: new ranks, a new reference; the first summary after a full period.
    compute_round_ = round.round;
    compute_window_.Reset();
    next_compute_publish_ = now + period;
    next_judgement_ = now + period + period / 2;   // after the nodes' first summaries
    if (named_straggler_ && metrics) metrics->SetStraggler(false);
    named_straggler_ = false;
  }
  for (const auto& r : reports) {
    compute_window_.Add(round.rank_offset + r.local_rank, now, r.compute_ns, r.compute_steps);
  }
  if (now >= next_compute_publish_) {
    next_compute_publish_ = now + period;
    const std::map<int, double> summary = compute_window_.Summary(now, period);
    if (metrics) metrics->SetRankCompute(summary);
    if (!summary.empty()) {
      rdzv::ComputeRecord rec;
      rec.round = round.round;
      rec.seq = ++compute_seq_;
      rec.compute_s = summary;
      rdzv_.PublishCompute(rec);
    }
    // Whether the judge names this node now: one small read per period.
    auto named = rdzv_.ReadStragglers();
    if (!named.ok()) {
      WarnRead(named.status());
    } else {
      const rdzv::StragglerRecord::Node* me = nullptr;
      if (*named && (*named)->round == round.round) {
        for (const auto& n : (*named)->nodes) {
          if (n.id == config_.node_id) me = &n;
        }
      }
      if ((me != nullptr) != named_straggler_) {
        named_straggler_ = me != nullptr;
        if (metrics) metrics->SetStraggler(named_straggler_);
        if (me != nullptr && policy.evict) return Evict(round, *me);
        if (me != nullptr) {
          EFDL_LOG_WARN("job {} round {}: this node ({}) is named a straggler: {} {:.3f} s of "
                        "compute per step vs the median {:.3f} s of the other nodes' ranks; it "
                        "stays in the job (efdl run --evict-stragglers would remove it)",
                        config_.job_id, round.round, config_.node_id, RanksText(me->ranks),
                        me->compute_s, me->median_s);
        }
      }
    }
  }
  if (round.node_rank == 0 && now >= next_judgement_) {
    next_judgement_ = now + period;
    Judge(round);
  } else if (round.node_rank != 0 && judge_) {
    judge_.reset();   // no longer the judge (a new round placed this node elsewhere)
    straggler_since_.clear();
  }
  return std::nullopt;
}

void StragglerWatch::Judge(const rdzv::Assignment& round) {
  const health::StragglerPolicy& policy = config_.policy;
  if (!judge_) judge_.emplace(policy);
  auto all = rdzv_.ReadCompute();
  if (!all.ok()) {
    WarnRead(all.status());
    return;
  }
  std::vector<health::NodeCompute> latest;
  for (const auto& [node, rec] : *all) latest.push_back({node, rec.round, rec.seq, rec.compute_s});
  const health::StragglerJudge::Verdict v = judge_->Judge(round.round, latest);
  for (const auto& s : v.named) {
    straggler_since_[s.node] = IsoNow();
    EFDL_LOG_WARN("job {} round {}: node {} is a straggler: {} {:.3f} s of compute per step, "
                  "{:.1f}x the median {:.3f} s of the other nodes' ranks, in {} summaries in a "
                  "row ({:.0f} s; --straggler-factor {:g}){}",
                  config_.job_id, round.round, s.node, RanksText(s.ranks), s.compute_s,
                  s.ratio(), s.median_s, s.windows,
                  Secs(health::PublishPeriod(policy, round.nnodes)) * s.windows, policy.factor,
                  policy.evict ? "; --evict-stragglers: it leaves the job while MIN allows"
                               : "; efdl run --evict-stragglers would remove it from the job");
  }
  for (const auto& node : v.cleared) {
    straggler_since_.erase(node);
    EFDL_LOG_INFO("job {} round {}: node {} is no longer a straggler", config_.job_id,
                  round.round, node);
  }
  if (!v.changed()) return;
  rdzv::StragglerRecord rec;
  rec.round = round.round;
  rec.judge = config_.node_id;
  rec.time = IsoNow();
  rec.factor = policy.factor;
  rec.window_s = Secs(policy.window);
  for (const auto& s : v.stragglers) {
    rec.nodes.push_back({s.node, s.ranks, s.compute_s, s.median_s, s.windows,
                         straggler_since_[s.node]});
  }
  if (Status st = rdzv_.RecordStragglers(rec); !st.ok()) EFDL_LOG_WARN("{}", st.message());
}

std::optional<StragglerWatch::Eviction> StragglerWatch::Evict(
    const rdzv::Assignment& round, const rdzv::StragglerRecord::Node& me) {
  const std::string what = fmt::format(
      "{} {:.3f} s of compute per step, {:.1f}x the median {:.3f} s of the other nodes' ranks",
      RanksText(me.ranks), me.compute_s, me.median_s > 0 ? me.compute_s / me.median_s : 0.0,
      me.median_s);
  // The job goes on without this node only with MIN other nodes (as for an exclusion).
  const int others = round.nnodes - 1;
  if (others < std::max(1, config_.min_nodes)) {
    if (!straggler_min_noted_) {
      straggler_min_noted_ = true;
      EFDL_LOG_WARN("job {} round {}: this node ({}) is a straggler ({}), but the job cannot go "
                    "on without it ({} other node(s), --nnodes MIN {}): it stays",
                    config_.job_id, round.round, config_.node_id, what, others,
                    config_.min_nodes);
    }
    return std::nullopt;
  }
  health::ExclusionPolicy cooldown_policy;
  cooldown_policy.cooldown = config_.exclude_cooldown;
  Eviction out;
  const int exclusion = ++straggler_exclusions_;
  out.cooldown = health::CooldownFor(cooldown_policy, exclusion);
  rdzv::ExclusionRecord& rec = out.record;
  rec.cause = "straggler";
  rec.reason = fmt::format("straggler in round {}: {} (--straggler-factor {:g}, "
                           "--evict-stragglers)",
                           round.round, what, config_.policy.factor);
  rec.time = IsoNow();
  rec.until = IsoIn(out.cooldown);
  rec.exclusion = exclusion;
  EFDL_LOG_WARN("node {} is evicted from job '{}' for {:g} s as a straggler (exclusion {}): {}; the "
                "job goes on without it from the next round, and it rejoins with fresh workers "
                "at {}",
                config_.node_id, config_.job_id, Secs(out.cooldown), exclusion, rec.reason,
                rec.until);
  if (config_.metrics) config_.metrics->SetStraggler(false);
  named_straggler_ = false;
  return out;
}

}  // namespace efdl::agent
