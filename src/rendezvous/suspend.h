// Suspend and resume of a job (EFDL-SPEC section 4): the etcd side shared by `efdl suspend`,
// `efdl resume`, `efdl status` and the rendezvous. Keys and the `suspended` phase of P round are
// described in protocol.h; the agent's part (stop workers gracefully, verify the persisted step,
// report it, leave) is in src/agent/agent.cc.
//
// All functions are stateless and thread-safe as far as the etcd::Client is.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "efdl/status.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {

// What etcd says about a job's suspension, read in one request.
struct SuspensionInfo {
  bool exists = false;                          // P round exists
  Phase phase = Phase::kGathering;
  int64_t round = 0;
  std::string message;                          // P round's msg
  std::vector<std::string> live_nodes;          // agents still registered (lease alive)
  std::map<std::string, SuspendReport> reports; // P suspended/<node>, by node id
  std::optional<int64_t> step;                  // JobSuspendStep(reports)
  std::optional<SuspendReport> point;           // JobSuspendPoint(reports)
  bool suspended() const { return phase == Phase::kSuspended; }
};

// The snapshot the job will resume from, among the nodes' reports: the one with the highest
// commit sequence number (a step count may start again at 0 each epoch, so the largest step can
// be an older snapshot); reports without one (older agents) by their step. In a data-parallel
// job only global rank 0 writes storage, so other nodes may report none. nullopt: none did.
std::optional<SuspendReport> JobSuspendPoint(const std::map<std::string, SuspendReport>& reports);
// JobSuspendPoint's step.
std::optional<int64_t> JobSuspendStep(const std::map<std::string, SuspendReport>& reports);
// "step 0 (epoch 5, snapshot 57)", or "step 25" when sequence and epoch are unknown.
std::string DescribeSuspendPoint(const SuspendReport& point);

// The one line an agent of a suspended job exits with.
std::string SuspendedJobMessage(const std::string& job_id,
                                const std::optional<SuspendReport>& point);

Result<SuspensionInfo> ReadSuspension(etcd::Client& client, const std::string& job_id);

struct SuspendOutcome {
  bool already = false;      // the job was suspended before this call
  int64_t round = 0;         // the round that was running (or last ran)
};

// Marks the job suspended: a CAS on P round (retried when a proposal races it), so every
// rendezvous sees it on its round watch and no new round can form. Reports of an earlier
// suspension are removed in the same txn. NotFound: no such job; FailedPrecondition: the job is
// complete.
Result<SuspendOutcome> MarkSuspended(etcd::Client& client, const std::string& job_id);

// Clears the mark: P round becomes gathering(r+1) with no coordinator (the first agent to join
// takes over), and the last run's assign/, ack/ and suspended/ keys are removed. Returns the step
// the job was suspended at. FailedPrecondition when the job is not suspended, or while agents of
// the suspension are still registered (still stopping their workers).
Result<std::optional<int64_t>> ResumeJob(etcd::Client& client, const std::string& job_id);

}  // namespace efdl::rdzv
