// MemoryEtcd: an in-memory etcd::Client with etcd's semantics, for unit tests of pure logic.
//
// What it models: one global revision bumped once per mutating request (a txn's writes share
// one revision), create/mod revision and version per key, prefix ranges with sort, limit and
// revision filters, txn compares (AND-ed), leases with TTLs measured on an injectable clock,
// keep-alive keepers that refresh their lease until paused, and watches that replay history from
// a start revision and deliver each revision's events in order, as one update per revision.
// What it does not model: network failures and auth; Compact only trims the watch history.
//
// Thread-safety: every method may be called from any thread. Watch callbacks and keeper
// `on_lost` callbacks run on one dispatcher thread owned by the MemoryEtcd, one at a time, in
// the order their causes happened. A Watch or LeaseKeeper must be destroyed before its
// MemoryEtcd.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "efdl/etcd.h"

namespace efdl::testing {

class MemoryEtcd final : public etcd::Client {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  // Request and traffic counts, as a real server would see them.
  struct Stats {
    int64_t ranges = 0, puts = 0, deletes = 0, txns = 0, lease_grants = 0, lease_revokes = 0,
            watches_started = 0;
    int64_t watch_events = 0;     // events delivered to callbacks
    int64_t bytes_written = 0;    // keys + values sent in puts (also inside txns)
    int64_t bytes_read = 0;       // keys + values returned by ranges and delivered by watches
    int64_t requests() const { return ranges + puts + deletes + txns + lease_grants + lease_revokes; }
  };

  // `clock` decides lease expiry; the default is std::chrono::steady_clock::now.
  explicit MemoryEtcd(Clock clock = {});
  ~MemoryEtcd() override;
  MemoryEtcd(const MemoryEtcd&) = delete;
  MemoryEtcd& operator=(const MemoryEtcd&) = delete;

  Result<etcd::RangeResult> Range(const std::string& key,
                                  const etcd::RangeOptions& options = {}) override;
  Result<std::optional<etcd::KeyValue>> Get(const std::string& key) override;
  Result<etcd::PutResult> Put(const std::string& key, const std::string& value,
                              int64_t lease = 0) override;
  Result<etcd::DeleteResult> Delete(const std::string& key, bool prefix = false) override;
  Result<etcd::TxnResult> Txn(const std::vector<etcd::Compare>& compares,
                              const std::vector<etcd::TxnOp>& then,
                              const std::vector<etcd::TxnOp>& otherwise = {}) override;
  Result<etcd::LeaseGrantResult> LeaseGrant(int64_t ttl_seconds) override;
  Status LeaseRevoke(int64_t lease_id) override;
  Result<int64_t> LeaseTimeToLive(int64_t lease_id) override;
  Result<std::unique_ptr<etcd::LeaseKeeper>> KeepAlive(int64_t lease_id,
                                                       std::function<void()> on_lost) override;
  Result<std::unique_ptr<etcd::Watch>> StartWatch(const std::string& key,
                                                  const etcd::WatchOptions& options,
                                                  etcd::WatchCallback callback) override;
  Status Compact(int64_t revision) override;
  Result<int64_t> CurrentRevision() override;

  // Test controls.
  // Ends a lease now, as if its TTL ran out: its keys are deleted and its keepers told.
  void Expire(int64_t lease_id);
  // While paused, keepers of this lease stop refreshing it (a frozen or partitioned agent), so
  // it expires when its TTL runs out on the clock.
  void PauseKeepAlive(int64_t lease_id, bool paused);
  // Expires every lease whose deadline passed on the clock (the dispatcher also does this about
  // every 20 ms; tests with a manual clock call it after advancing).
  void ExpireDueLeases();
  // When set, every request fails with Unavailable (an etcd that cannot be reached).
  void SetUnavailable(bool unavailable) { unavailable_ = unavailable; }
  Stats stats() const;
  void ResetStats();
  // Blocks until every callback queued so far has run (or `timeout` passes); true if drained.
  bool WaitIdle(std::chrono::milliseconds timeout);

 private:
  struct LeaseState {
    int64_t ttl_seconds = 0;
    std::chrono::steady_clock::time_point deadline;
    std::set<std::string> keys;
    int keepers = 0;
    bool paused = false;
  };
  struct WatchState {
    std::string key;
    bool prefix = false;
    etcd::WatchCallback callback;
  };
  struct Delivery {
    int64_t watch_id = 0;              // 0: a plain task (keeper on_lost)
    etcd::WatchUpdate update;
    std::function<void()> task;
  };
  class WatchHandle;
  class KeeperHandle;

  bool Matches(const WatchState& w, const std::string& key) const;
  std::vector<etcd::KeyValue> RangeLocked(const std::string& key,
                                          const etcd::RangeOptions& options) const;
  // Applies one write at `revision`; appends its event to `events`.
  void PutLocked(const std::string& key, const std::string& value, int64_t lease,
                 int64_t revision, std::vector<etcd::WatchEvent>& events);
  int64_t DeleteLocked(const std::string& key, bool prefix, int64_t revision,
                       std::vector<etcd::WatchEvent>& events);
  bool CompareHolds(const etcd::Compare& c) const;
  // Records a revision's events in history and queues them to the matching watches.
  void PublishLocked(int64_t revision, const std::vector<etcd::WatchEvent>& events);
  void EndLeaseLocked(int64_t lease_id);
  void RefreshKeptLeasesLocked();
  void CancelWatch(int64_t watch_id);
  void ReleaseKeeper(int64_t keeper_id);
  void DispatchLoop();
  Status CheckAvailable() const;

  Clock clock_;
  std::atomic<bool> unavailable_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;          // dispatcher wake-ups and WaitIdle / cancel waits
  std::map<std::string, etcd::KeyValue> kvs_;
  std::vector<std::pair<int64_t, etcd::WatchEvent>> history_;  // (revision, event)
  int64_t revision_ = 1;
  int64_t compact_revision_ = 0;
  std::map<int64_t, LeaseState> leases_;
  int64_t next_lease_ = 0x1000;
  std::map<int64_t, WatchState> watches_;
  int64_t next_watch_ = 1;
  struct KeeperState {
    int64_t lease_id = 0;
    std::function<void()> on_lost;
    bool fired = false;
  };
  std::map<int64_t, KeeperState> keepers_;
  int64_t next_keeper_ = 1;
  std::deque<Delivery> queue_;
  int64_t running_watch_ = 0;           // the watch whose callback runs now (0: none)
  bool dispatching_ = false;            // a delivery is running outside the lock
  std::thread::id dispatcher_id_;
  bool stop_ = false;
  Stats stats_;
  std::thread dispatcher_;              // last: starts after every member above exists
};

}  // namespace efdl::testing
