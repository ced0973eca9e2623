#include "rendezvous/suspend.h"

#include <fmt/format.h>

#include <algorithm>

namespace efdl::rdzv {

namespace {

// A CAS on P round loses only to another writer of it (a proposal, a takeover); a few retries
// always win against a job's own coordinator, which writes at most a few times per round.
constexpr int kCasAttempts = 20;

struct RoundRead {
  RoundRecord record;
  int64_t mod_revision = 0;
};

Result<std::optional<RoundRead>> ReadRound(etcd::Client& client, const JobKeys& keys,
                                           const std::string& job_id) {
  auto got = client.Get(keys.round);
  if (!got.ok()) return got.status().WithContext(fmt::format("cannot read job {}", job_id));
  if (!got->has_value()) return std::optional<RoundRead>();
  auto rec = RoundRecord::Decode((*got)->value);
  if (!rec.ok()) {
    return rec.status().WithContext(fmt::format("job {} has a damaged round record", job_id));
  }
  return std::optional<RoundRead>(RoundRead{*rec, (*got)->mod_revision});
}

Status NoSuchJob(const std::string& job_id) {
  return Status::NotFound(fmt::format(
      "no job '{}' in etcd: check --job and --etcd (a job exists once one of its agents ran)",
      job_id));
}

}  // namespace

std::optional<SuspendReport> JobSuspendPoint(const std::map<std::string, SuspendReport>& reports) {
  std::optional<SuspendReport> best;
  for (const auto& [node, report] : reports) {
    if (!report.step) continue;
    const bool newer = !best ||
                       (report.seq && (!best->seq || *report.seq > *best->seq)) ||
                       (!report.seq && !best->seq && *report.step > *best->step);
    if (newer) best = report;
  }
  return best;
}

std::optional<int64_t> JobSuspendStep(const std::map<std::string, SuspendReport>& reports) {
  auto point = JobSuspendPoint(reports);
  return point ? point->step : std::nullopt;
}

std::string DescribeSuspendPoint(const SuspendReport& point) {
  std::string out = point.step ? fmt::format("step {}", *point.step) : "no step";
  std::vector<std::string> more;
  if (point.epoch) more.push_back(fmt::format("epoch {}", *point.epoch));
  if (point.seq) more.push_back(fmt::format("snapshot {}", *point.seq));
  if (!more.empty()) out += fmt::format(" ({})", fmt::join(more, ", "));
  return out;
}

std::string SuspendedJobMessage(const std::string& job_id,
                                const std::optional<SuspendReport>& point) {
  if (point) {
    return fmt::format("job {} is suspended at {}; run `efdl resume --job {}` to continue",
                       job_id, DescribeSuspendPoint(*point), job_id);
  }
  return fmt::format(
      "job {} is suspended (no persisted snapshot was reported); run `efdl resume --job {}` to "
      "continue",
      job_id, job_id);
}

Result<SuspensionInfo> ReadSuspension(etcd::Client& client, const std::string& job_id) {
  EFDL_RETURN_IF_ERROR(ValidateId("job id", job_id));
  JobKeys keys(job_id);
  auto snap = client.Txn({}, {etcd::TxnOp::Get(keys.round), etcd::TxnOp::Get(keys.nodes, true),
                              etcd::TxnOp::Get(keys.suspended, true)});
  if (!snap.ok()) return snap.status().WithContext(fmt::format("cannot read job {}", job_id));
  if (snap->gets.size() != 3) return Status::Internal("etcd answered a short transaction");
  SuspensionInfo out;
  if (!snap->gets[0].kvs.empty()) {
    auto rec = RoundRecord::Decode(snap->gets[0].kvs[0].value);
    if (!rec.ok()) {
      return rec.status().WithContext(fmt::format("job {} has a damaged round record", job_id));
    }
    out.exists = true;
    out.phase = rec->phase;
    out.round = rec->round;
    out.message = rec->message;
  }
  for (const auto& kv : snap->gets[1].kvs) out.live_nodes.push_back(kv.key.substr(keys.nodes.size()));
  for (const auto& kv : snap->gets[2].kvs) {
    auto report = SuspendReport::Decode(kv.value);
    // A damaged report counts as "no step" rather than hiding the others.
    out.reports[kv.key.substr(keys.suspended.size())] = report.ok() ? *report : SuspendReport{};
  }
  out.point = JobSuspendPoint(out.reports);
  out.step = out.point ? out.point->step : std::nullopt;
  return out;
}

Result<SuspendOutcome> MarkSuspended(etcd::Client& client, const std::string& job_id) {
  EFDL_RETURN_IF_ERROR(ValidateId("job id", job_id));
  JobKeys keys(job_id);
  for (int attempt = 0; attempt < kCasAttempts; ++attempt) {
    auto read = ReadRound(client, keys, job_id);
    if (!read.ok()) return read.status();
    if (!read->has_value()) return NoSuchJob(job_id);
    const RoundRecord& current = (*read)->record;
    if (current.phase == Phase::kSuspended) return SuspendOutcome{true, current.round};
    if (current.phase == Phase::kComplete) {
      return Status::FailedPrecondition(
          fmt::format("job {} is complete: there is nothing to suspend", job_id));
    }
    RoundRecord next;
    next.round = current.round;
    next.phase = Phase::kSuspended;
    next.graceful = true;
    next.message = fmt::format("suspended in round {} by efdl suspend", current.round);
    auto txn = client.Txn({etcd::Compare::ModRevisionIs(keys.round, (*read)->mod_revision)},
                          {etcd::TxnOp::Put(keys.round, next.Encode()),
                           etcd::TxnOp::Delete(keys.suspended, /*prefix=*/true)});
    if (!txn.ok()) {
      return txn.status().WithContext(fmt::format("cannot mark job {} suspended", job_id));
    }
    if (txn->succeeded) return SuspendOutcome{false, current.round};
  }
  return Status::Unavailable(fmt::format(
      "job {}: the round record kept changing while marking the job suspended; run `efdl "
      "suspend` again",
      job_id));
}

Result<std::optional<int64_t>> ResumeJob(etcd::Client& client, const std::string& job_id) {
  EFDL_RETURN_IF_ERROR(ValidateId("job id", job_id));
  JobKeys keys(job_id);
  auto info = ReadSuspension(client, job_id);
  if (!info.ok()) return info.status();
  if (!info->exists) return NoSuchJob(job_id);
  if (!info->suspended()) {
    return Status::FailedPrecondition(fmt::format(
        "job {} is not suspended (it is {}): nothing to resume", job_id, PhaseName(info->phase)));
  }
  if (!info->live_nodes.empty()) {
    return Status::FailedPrecondition(fmt::format(
        "job {}: {} agent(s) are still stopping their workers ({}); wait for `efdl suspend` to "
        "finish, then resume",
        job_id, info->live_nodes.size(), fmt::join(info->live_nodes, ", ")));
  }
  auto read = ReadRound(client, keys, job_id);
  if (!read.ok()) return read.status();
  if (!read->has_value() || (*read)->record.phase != Phase::kSuspended) {
    return Status::FailedPrecondition(
        fmt::format("job {} changed while resuming it; run `efdl resume` again", job_id));
  }
  RoundRecord next;
  next.round = (*read)->record.round + 1;
  next.phase = Phase::kGathering;
  next.message = info->point ? fmt::format("resumed (suspended at {})",
                                           DescribeSuspendPoint(*info->point))
                            : std::string("resumed (no persisted step was reported)");
  // Guarded by P round only: an agent that starts between the read and this txn is refused by
  // the suspended record, and one that starts after it joins the resumed job.
  auto txn = client.Txn(
      {etcd::Compare::ModRevisionIs(keys.round, (*read)->mod_revision)},
      {etcd::TxnOp::Put(keys.round, next.Encode()), etcd::TxnOp::Delete(keys.assign, true),
       etcd::TxnOp::Delete(keys.ack, true), etcd::TxnOp::Delete(keys.suspended, true)});
  if (!txn.ok()) return txn.status().WithContext(fmt::format("cannot resume job {}", job_id));
  if (!txn->succeeded) {
    return Status::FailedPrecondition(
        fmt::format("job {} changed while resuming it; run `efdl resume` again", job_id));
  }
  return info->step;
}

}  // namespace efdl::rdzv
