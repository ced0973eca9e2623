// The persistence settings of a job's snapshots, read from the environment in one place: the node
// agent (agent/agent_persister.h) and python/efdl/state.py (through efdl._efdl.persist_settings)
// both call PersistSettingsFromEnvironment, so a worker and its agent, which share the
// environment, always agree on them and refuse the same bad values with the same words.
//
//   EFDL_SNAPSHOT_PER_RANK        integer flag (0: one copy per node; not 0: one per rank), 0
//   EFDL_SNAPSHOT_KEEP            snapshots kept in storage, >= 1, default 2
//   EFDL_PERSIST_MIN_INTERVAL_MS  least time between two storage writes, default 1000; a negative
//                                 value counts as 0 (no limit), one over a year as a year
//   EFDL_SNAPSHOT_HMAC            on for 1/true/yes/on (any case, surrounding blanks ignored), any
//                                 other value off; on needs the job's secret, which becomes the key
//
// Integers: surrounding ASCII blanks are ignored, unset or blank is the default, otherwise the
// value must be a decimal integer with an optional sign that fits 64 bits.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "efdl/status.h"

namespace efdl::snapshot {

struct PersistSettings {
  bool per_rank = false;
  int keep = 2;
  std::chrono::milliseconds min_interval{1000};
  std::string hmac_key;  // the job's secret when EFDL_SNAPSHOT_HMAC is on, else empty
};

// `getenv` looks a variable up (nullptr: unset); injectable for tests. `job_secret` is the job's
// secret as this process knows it (empty: none). InvalidArgument with one line naming the variable
// and what to do for a value that is refused.
Result<PersistSettings> PersistSettingsFromEnvironment(
    const std::function<const char*(const char*)>& getenv, std::string job_secret);

}  // namespace efdl::snapshot
