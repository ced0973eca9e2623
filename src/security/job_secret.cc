#include "security/job_secret.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "common/job_spec.h"

namespace efdl::security {

namespace {
constexpr size_t kSecretBytes = 32;
}  // namespace

Result<std::string> NewSecret() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  unsigned char bytes[kSecretBytes];
  if (!in.read(reinterpret_cast<char*>(bytes), sizeof(bytes))) {
    return Status::IOError(fmt::format("cannot read /dev/urandom for the job secret: {}",
                                       std::strerror(errno)));
  }
  std::string hex;
  hex.reserve(2 * kSecretBytes);
  for (unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  return hex;
}

bool IsValidSecret(const std::string& secret) {
  if (secret.size() != 2 * kSecretBytes) return false;
  for (char c : secret) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string JobSecretKey(const std::string& job_id) {
  return JobKeyPrefix(job_id) + "secret";
}

Result<std::string> EnsureJobSecret(etcd::Client& client, const std::string& job_id) {
  const std::string key = JobSecretKey(job_id);
  EFDL_ASSIGN_OR_RETURN(std::string fresh, NewSecret());
  EFDL_ASSIGN_OR_RETURN(etcd::TxnResult txn,
                        client.Txn({etcd::Compare::KeyMissing(key)},
                                   {etcd::TxnOp::Put(key, fresh)}, {etcd::TxnOp::Get(key)}));
  if (txn.succeeded) return fresh;
  if (txn.gets.empty() || txn.gets[0].kvs.empty()) {
    return Status::Internal(fmt::format("etcd answered no value for the existing key {}", key));
  }
  const std::string& existing = txn.gets[0].kvs[0].value;
  if (!IsValidSecret(existing)) {
    return Status::FailedPrecondition(fmt::format(
        "etcd key {} holds no job secret (expected 64 hex digits, found {} bytes); something "
        "else wrote it: delete it (etcdctl del {}) and start the job again",
        key, existing.size(), key));
  }
  return existing;
}

}  // namespace efdl::security
