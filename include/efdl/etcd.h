// The etcd v3 key-value store as EFDL uses it: KV, transactions, leases and watches.
//
// `etcd::Client` is an interface so that pure logic (rendezvous rounds, the simulator's
// bookkeeping) can be unit-tested against an in-memory fake; `etcd::Connect()` returns the real
// gRPC client. All methods are thread-safe; one client serves a whole process. Every call is
// bounded by `ClientOptions::call_timeout` and reports failure as a Status, never by throwing.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "efdl/status.h"

namespace efdl::etcd {

using Duration = std::chrono::milliseconds;

struct KeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  int64_t lease = 0;
};

struct RangeOptions {
  enum class SortOrder { kNone, kAscend, kDescend };
  enum class SortTarget { kKey, kVersion, kCreateRevision, kModRevision, kValue };

  bool prefix = false;      // every key that starts with `key`
  int64_t limit = 0;        // 0: no limit
  int64_t revision = 0;     // 0: newest
  bool keys_only = false;
  bool count_only = false;
  // Server-side order of the answer (applied before `limit`). kNone: etcd's key order.
  SortOrder sort_order = SortOrder::kNone;
  SortTarget sort_target = SortTarget::kKey;
  // Filters on the keys' revisions; 0: no bound. Bounds are inclusive. Note that etcd applies
  // these after `limit`, so combine them with a limit only when that is what you mean.
  int64_t min_create_revision = 0;
  int64_t max_create_revision = 0;
  int64_t min_mod_revision = 0;
  int64_t max_mod_revision = 0;
};

struct RangeResult {
  std::vector<KeyValue> kvs;
  int64_t count = 0;        // keys in range (may exceed kvs.size() with a limit)
  bool more = false;        // true when a limit cut the answer short
  int64_t revision = 0;     // the store's revision when the range was served
};

struct PutResult {
  int64_t revision = 0;
};

struct DeleteResult {
  int64_t deleted = 0;
  int64_t revision = 0;
};

// One comparison of a transaction's guard.
struct Compare {
  enum class Target { kVersion, kCreateRevision, kModRevision, kValue };
  enum class Op { kEqual, kGreater, kLess, kNotEqual };
  std::string key;
  Target target = Target::kVersion;
  Op op = Op::kEqual;
  int64_t number = 0;      // for version / create_revision / mod_revision
  std::string value;       // for kValue

  // Common guards, spelled for readability at call sites.
  static Compare KeyMissing(std::string key) {  // create-only
    return {std::move(key), Target::kCreateRevision, Op::kEqual, 0, {}};
  }
  static Compare ModRevisionIs(std::string key, int64_t rev) {
    return {std::move(key), Target::kModRevision, Op::kEqual, rev, {}};
  }
  static Compare VersionIs(std::string key, int64_t version) {
    return {std::move(key), Target::kVersion, Op::kEqual, version, {}};
  }
  static Compare ValueIs(std::string key, std::string value) {
    return {std::move(key), Target::kValue, Op::kEqual, 0, std::move(value)};
  }
};

// One operation of a transaction's then/else list.
struct TxnOp {
  enum class Type { kPut, kDelete, kGet };
  Type type = Type::kGet;
  std::string key;
  std::string value;       // kPut
  int64_t lease = 0;       // kPut
  bool prefix = false;     // kDelete / kGet

  static TxnOp Put(std::string key, std::string value, int64_t lease = 0) {
    return {Type::kPut, std::move(key), std::move(value), lease, false};
  }
  static TxnOp Delete(std::string key, bool prefix = false) {
    return {Type::kDelete, std::move(key), {}, 0, prefix};
  }
  static TxnOp Get(std::string key, bool prefix = false) {
    return {Type::kGet, std::move(key), {}, 0, prefix};
  }
};

struct TxnResult {
  bool succeeded = false;            // the guard held and `then` ran (else `otherwise` ran)
  int64_t revision = 0;
  std::vector<RangeResult> gets;     // one per kGet op that ran, in order
};

struct LeaseGrantResult {
  int64_t id = 0;
  int64_t ttl_seconds = 0;
};

// Keeps one lease alive on the client's own keep-alive thread (never a Python thread), renewing
// at TTL/3 and re-opening a broken stream. `on_lost` runs once, on that thread, the moment the
// lease is known to be gone (expired, revoked, or not renewed within its TTL). Destroying the
// keeper stops renewing (it does not revoke).
class LeaseKeeper {
 public:
  virtual ~LeaseKeeper() = default;
  virtual int64_t lease_id() const = 0;
  virtual bool lost() const = 0;
  // Until when the lease is known to live (the last renewal's send time + its TTL, on this
  // machine's steady clock): past it etcd may have expired the lease - after a freeze, say -
  // even before lost() turns true. Thread-safe. Default: no local expiry known.
  virtual std::chrono::steady_clock::time_point expires_at() const {
    return std::chrono::steady_clock::time_point::max();
  }
};

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  KeyValue kv;  // for kDelete: key and mod_revision of the deletion
};

// What a watch callback receives. Exactly one of: events (in revision order), a compaction
// (the start revision is gone: re-read, then re-watch from the read's revision + 1), or a
// terminal error (the watch is over).
struct WatchUpdate {
  std::vector<WatchEvent> events;
  int64_t revision = 0;               // header revision of the response
  bool compacted = false;
  int64_t compact_revision = 0;       // with compacted: the oldest revision still available
  Status error;                       // not OK: the watch ended and will deliver nothing more
};

using WatchCallback = std::function<void(const WatchUpdate&)>;

// A live watch. Destroying it cancels the watch; after the destructor returns the callback is
// not running and will not run again.
class Watch {
 public:
  virtual ~Watch() = default;
  // Waits until etcd serves the watch, within the client's call timeout (for a watch started
  // with WatchOptions::wait_created = false; a no-op on a watch's own callback thread and for
  // clients without a server). Watches started together and waited for afterwards cost one
  // round trip, not one each.
  virtual Status WaitCreated() { return Status::OK(); }
};

struct WatchOptions {
  bool prefix = false;
  int64_t start_revision = 0;   // 0: from now
  bool progress_notify = false;
  // true: StartWatch returns once etcd serves the watch. false: as soon as the watch is queued
  // (the caller may wait later with Watch::WaitCreated). Every event from start_revision on is
  // delivered either way; waiting only means that the first ones come without delay.
  bool wait_created = true;
};

class Client {
 public:
  virtual ~Client() = default;

  // Range over one key (or a prefix, with options.prefix).
  virtual Result<RangeResult> Range(const std::string& key, const RangeOptions& options = {}) = 0;
  // One key's value, or std::nullopt when it does not exist.
  virtual Result<std::optional<KeyValue>> Get(const std::string& key);
  virtual Result<PutResult> Put(const std::string& key, const std::string& value,
                                int64_t lease = 0) = 0;
  virtual Result<DeleteResult> Delete(const std::string& key, bool prefix = false) = 0;
  virtual Result<TxnResult> Txn(const std::vector<Compare>& compares,
                                const std::vector<TxnOp>& then,
                                const std::vector<TxnOp>& otherwise = {}) = 0;

  virtual Result<LeaseGrantResult> LeaseGrant(int64_t ttl_seconds) = 0;
  virtual Status LeaseRevoke(int64_t lease_id) = 0;
  // Remaining TTL in seconds; NotFound when the lease is gone.
  virtual Result<int64_t> LeaseTimeToLive(int64_t lease_id) = 0;
  virtual Result<std::unique_ptr<LeaseKeeper>> KeepAlive(int64_t lease_id,
                                                         std::function<void()> on_lost) = 0;
  // KeepAlive for a lease this client was just granted: `granted` is the grant's answer and
  // `asked` when the grant was sent (the local expiry counts from then), so no time-to-live read
  // goes first (issue #37: one request less per registration). The default reads it anyway.
  virtual Result<std::unique_ptr<LeaseKeeper>> KeepGranted(
      const LeaseGrantResult& granted, std::chrono::steady_clock::time_point asked,
      std::function<void()> on_lost) {
    (void)asked;
    return KeepAlive(granted.id, std::move(on_lost));
  }

  // Starts a watch; callbacks run on the client's watch thread, one at a time per client, and
  // must not block for long. Many watches share one stream.
  virtual Result<std::unique_ptr<Watch>> StartWatch(const std::string& key,
                                                    const WatchOptions& options,
                                                    WatchCallback callback) = 0;

  // Discards history up to (not including) `revision`; watches and ranges at older revisions
  // then report compaction. A fake may leave this unimplemented (the default says so).
  virtual Status Compact(int64_t revision);
  // A cheap round trip that proves the cluster answers (a one-key count range); the store's
  // current revision on success. Used for health checks and to wait for an etcd to come up.
  virtual Result<int64_t> CurrentRevision();
};

// TLS to etcd (https endpoints). PEM file paths, read by Connect(); all empty: plaintext.
struct TlsOptions {
  std::string ca_file;    // CAs trusted for the server's certificate (empty: the system's roots)
  std::string cert_file;  // client certificate, for etcd's --client-cert-auth (with key_file)
  std::string key_file;
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

// Told of every request's outcome, after its retries (metrics: src/metrics/agent_metrics.h):
// the operation ("range", "put", "transaction", "lease keep-alive", ...), the seconds it took
// and whether it succeeded. Called on the caller's thread: cheap and thread-safe.
class CallObserver {
 public:
  virtual ~CallObserver() = default;
  virtual void OnCall(std::string_view operation, double seconds, bool ok) = 0;
  // A kept lease's renewal failed: "late" (its local expiry passed with no answer from etcd;
  // it may still be renewed in the grace) or "lost" (it expired or etcd no longer has it).
  // Called on the client's keep-alive thread.
  virtual void OnLeaseRenewalFailed(std::string_view outcome) { (void)outcome; }
};

struct ClientOptions {
  std::vector<std::string> endpoints;            // "host:port"
  Duration call_timeout = std::chrono::seconds(5);
  Duration connect_timeout = std::chrono::seconds(3);
  TlsOptions tls;
  // etcd user/password auth (etcd's Authenticate RPC). Empty user: no auth. The client sends
  // the token it gets as the "token" metadata and authenticates again when etcd says the token
  // is invalid or expired. The password stays in this struct only; it is never logged.
  std::string user;
  std::string password;
  // Null: none. Must outlive the client.
  CallObserver* observer = nullptr;
};

// Parses "host:port[,host:port...]" (an optional http:// prefix is accepted). Rejects empty
// lists, missing or non-numeric ports and ports out of range with a message naming the bad part.
Result<std::vector<std::string>> ParseEndpoints(const std::string& spec);

// Connects to the cluster through the real gRPC client (over TLS and authenticated when the
// options say so). Fails within connect_timeout with a message naming the endpoints when none
// answers, and with one line naming the cause for an unreadable certificate file, an untrusted
// server certificate, a refused client certificate, TLS to a plaintext endpoint (or plaintext
// to a TLS one), or a wrong user name or password.
Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);

// The smallest key greater than every key with this prefix (etcd's range_end for prefixes).
std::string PrefixRangeEnd(const std::string& prefix);

}  // namespace efdl::etcd
