// Stragglers in the agent (issue #32 part 3; the rule: src/health/straggler_rules.h;
// docs/operations.md "Stragglers"). The workers add their compute time per step to their
// progress slots (python/efdl/_compute.py); this agent samples them about every second,
// publishes a summary of its ranks every period under its lease, and reads whether the round's
// judge named it; node rank 0 of the round is the judge. Nothing per step goes to etcd.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <ctime>

#include "agent/agent.h"
#include "common/log.h"

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

void Agent::CheckStragglers() {
  const health::StragglerPolicy& policy = options_.stragglers;
  if (!policy.enabled() || !hang_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_compute_sample_) return;
  next_compute_sample_ = now + std::chrono::seconds(1);
  if (!group_ || group_paused_ || !hang_->armed() || assignment_.standby) return;
  const std::chrono::milliseconds period = health::PublishPeriod(policy, assignment_.nnodes);
  if (compute_round_ != assignment_.round) {
    // A new round: new ranks, a new reference; the first summary after a full period.
    compute_round_ = assignment_.round;
    compute_window_.Reset();
    next_compute_publish_ = now + period;
    next_judgement_ = now + period + period / 2;   // after the nodes' first summaries
    if (named_straggler_ && options_.metrics) options_.metrics->SetStraggler(false);
    named_straggler_ = false;
  }
  for (const auto& r : hang_->Progress()) {
    compute_window_.Add(assignment_.rank_offset + r.local_rank, now, r.compute_ns,
                        r.compute_steps);
  }
  if (now >= next_compute_publish_) {
    next_compute_publish_ = now + period;
    const std::map<int, double> summary = compute_window_.Summary(now, period);
    if (options_.metrics) options_.metrics->SetRankCompute(summary);
    if (!summary.empty()) {
      rdzv::ComputeRecord rec;
      rec.round = assignment_.round;
      rec.seq = ++compute_seq_;
      rec.compute_s = summary;
      rdzv_.PublishCompute(rec);
    }
    // Whether the judge names this node now: one small read per period.
    auto named = rdzv_.ReadStragglers();
    if (!named.ok()) {
      if (!straggler_read_warned_) {
        straggler_read_warned_ = true;
        EFDL_LOG_WARN("stragglers: {}", named.status().message());
      }
    } else {
      const rdzv::StragglerRecord::Node* me = nullptr;
      if (*named && (*named)->round == assignment_.round) {
        for (const auto& n : (*named)->nodes) {
          if (n.id == options_.node_id) me = &n;
        }
      }
      if ((me != nullptr) != named_straggler_) {
        named_straggler_ = me != nullptr;
        if (options_.metrics) options_.metrics->SetStraggler(named_straggler_);
        if (me != nullptr && policy.evict) {
          EvictAsStraggler(*me);
          return;
        }
        if (me != nullptr) {
          EFDL_LOG_WARN("job {} round {}: this node ({}) is named a straggler: {} {:.3f} s of "
                        "compute per step vs the median {:.3f} s of the other nodes' ranks; it "
                        "stays in the job (efdl run --evict-stragglers would remove it)",
                        options_.job_id, assignment_.round, options_.node_id,
                        RanksText(me->ranks), me->compute_s, me->median_s);
        }
      }
    }
  }
  if (assignment_.node_rank == 0 && now >= next_judgement_) {
    next_judgement_ = now + period;
    JudgeStragglers();
  } else if (assignment_.node_rank != 0 && judge_) {
    judge_.reset();   // no longer the judge (a new round placed this node elsewhere)
    straggler_since_.clear();
  }
}

void Agent::JudgeStragglers() {
  const health::StragglerPolicy& policy = options_.stragglers;
  if (!judge_) judge_.emplace(policy);
  auto all = rdzv_.ReadCompute();
  if (!all.ok()) {
    if (!straggler_read_warned_) {
      straggler_read_warned_ = true;
      EFDL_LOG_WARN("stragglers: {}", all.status().message());
    }
    return;
  }
  std::vector<health::NodeCompute> latest;
  for (const auto& [node, rec] : *all) latest.push_back({node, rec.round, rec.seq, rec.compute_s});
  const health::StragglerJudge::Verdict v = judge_->Judge(assignment_.round, latest);
  const int64_t round = assignment_.round;
  for (const auto& s : v.named) {
    straggler_since_[s.node] = IsoNow();
    EFDL_LOG_WARN("job {} round {}: node {} is a straggler: {} {:.3f} s of compute per step, "
                  "{:.1f}x the median {:.3f} s of the other nodes' ranks, in {} summaries in a "
                  "row ({:.0f} s; --straggler-factor {:g}){}",
                  options_.job_id, round, s.node, RanksText(s.ranks), s.compute_s, s.ratio(),
                  s.median_s, s.windows, Secs(health::PublishPeriod(policy, assignment_.nnodes)) *
                                             s.windows,
                  policy.factor,
                  policy.evict ? "; --evict-stragglers: it leaves the job while MIN allows"
                               : "; efdl run --evict-stragglers would remove it from the job");
  }
  for (const auto& node : v.cleared) {
    straggler_since_.erase(node);
    EFDL_LOG_INFO("job {} round {}: node {} is no longer a straggler", options_.job_id, round,
                  node);
  }
  if (!v.changed()) return;
  rdzv::StragglerRecord rec;
  rec.round = round;
  rec.judge = options_.node_id;
  rec.time = IsoNow();
  rec.factor = policy.factor;
  rec.window_s = Secs(policy.window);
  for (const auto& s : v.stragglers) {
    rec.nodes.push_back({s.node, s.ranks, s.compute_s, s.median_s, s.windows,
                         straggler_since_[s.node]});
  }
  if (Status st = rdzv_.RecordStragglers(rec); !st.ok()) EFDL_LOG_WARN("{}", st.message());
}

void Agent::EvictAsStraggler(const rdzv::StragglerRecord::Node& me) {
  const int64_t round = assignment_.round;
  const std::string what = fmt::format(
      "{} {:.3f} s of compute per step, {:.1f}x the median {:.3f} s of the other nodes' ranks",
      RanksText(me.ranks), me.compute_s, me.median_s > 0 ? me.compute_s / me.median_s : 0.0,
      me.median_s);
  // The job goes on without this node only with MIN other nodes (as for an exclusion).
  const int others = assignment_.nnodes - 1;
  if (others < std::max(1, options_.min_nodes)) {
    if (!straggler_min_noted_) {
      straggler_min_noted_ = true;
      EFDL_LOG_WARN("job {} round {}: this node ({}) is a straggler ({}), but the job cannot go "
                    "on without it ({} other node(s), --nnodes MIN {}): it stays",
                    options_.job_id, round, options_.node_id, what, others, options_.min_nodes);
    }
    return;
  }
  health::ExclusionPolicy cooldown_policy;
  cooldown_policy.cooldown = options_.exclude_cooldown;
  const int exclusion = ++straggler_exclusions_;
  const std::chrono::milliseconds cooldown = health::CooldownFor(cooldown_policy, exclusion);
  rdzv::ExclusionRecord rec;
  rec.cause = "straggler";
  rec.reason = fmt::format("straggler in round {}: {} (--straggler-factor {:g}, "
                           "--evict-stragglers)",
                           round, what, options_.stragglers.factor);
  rec.time = IsoNow();
  rec.until = IsoIn(cooldown);
  rec.exclusion = exclusion;
  EFDL_LOG_WARN("node {} is evicted from job '{}' for {:g} s as a straggler (exclusion {}): {}; the "
                "job goes on without it from the next round, and it rejoins with fresh workers "
                "at {}",
                options_.node_id, options_.job_id, Secs(cooldown), exclusion, rec.reason,
                rec.until);
  if (Status st = rdzv_.RecordExclusion(rec); !st.ok()) EFDL_LOG_WARN("{}", st.message());
  if (options_.metrics) options_.metrics->SetStraggler(false);
  named_straggler_ = false;
  // As a node that leaves on a signal does (Shutdown): out of the job first, so the others
  // re-round at once while this node's workers stop gracefully (their final snapshot); then as
  // Exclude does: no storage and no spares until the node takes part again.
  rdzv_.Withdraw(cooldown);
  StopWorkers(/*graceful=*/true, fmt::format("node {} is evicted as a straggler",
                                             options_.node_id));
  if (persister_) persister_->Clear();
  if (spares_) spares_->Clear();
  excluded_until_ = std::chrono::steady_clock::now() + cooldown;
}

}  // namespace efdl::agent
