// The job's secret: 32 random bytes (64 hex digits) made once per job by the first agent and
// kept in etcd at /efdl/<job>/secret (create-only: every agent of the job reads the same one).
// The agent hands it to its workers as EFDL_JOB_SECRET; it keys the snapshots' optional HMAC
// and is what EFDL's own listeners may ask a peer for. It is as secret as etcd access is:
// protect etcd with TLS and auth (docs/operations.md). Never log it.
#pragma once

#include <string>

#include "efdl/etcd.h"
#include "efdl/status.h"

namespace efdl::security {

// 64 lowercase hex digits from /dev/urandom.
Result<std::string> NewSecret();

// True for 64 lowercase hex digits.
bool IsValidSecret(const std::string& secret);

// The job's secret, created when absent. Thread-safe as far as `client` is; any number of
// agents may call it at once and all get the same value. Fails when etcd fails or the key holds
// something else than a secret (naming the key to delete).
Result<std::string> EnsureJobSecret(etcd::Client& client, const std::string& job_id);

// "/efdl/<job>/secret"
std::string JobSecretKey(const std::string& job_id);

}  // namespace efdl::security
