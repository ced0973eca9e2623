#include "support/memory_etcd.h"

#include <fmt/format.h>

#include <algorithm>

namespace efdl::testing {

using etcd::Compare;
using etcd::KeyValue;
using etcd::RangeOptions;
using etcd::TxnOp;
using etcd::WatchEvent;

class MemoryEtcd::WatchHandle final : public etcd::Watch {
 public:
  WatchHandle(MemoryEtcd* owner, int64_t id) : owner_(owner), id_(id) {}
  ~WatchHandle() override { owner_->CancelWatch(id_); }

 private:
  MemoryEtcd* owner_;
  int64_t id_;
};

class MemoryEtcd::KeeperHandle final : public etcd::LeaseKeeper {
 public:
  KeeperHandle(MemoryEtcd* owner, int64_t keeper_id, int64_t lease_id)
      : owner_(owner), keeper_id_(keeper_id), lease_id_(lease_id) {}
  ~KeeperHandle() override { owner_->ReleaseKeeper(keeper_id_); }
  int64_t lease_id() const override { return lease_id_; }
  bool lost() const override {
    std::lock_guard<std::mutex> lock(owner_->mu_);
    return owner_->leases_.count(lease_id_) == 0;
  }

 private:
  MemoryEtcd* owner_;
  int64_t keeper_id_;
  int64_t lease_id_;
};

MemoryEtcd::MemoryEtcd(Clock clock)
    : clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })),
      dispatcher_([this] { DispatchLoop(); }) {}

MemoryEtcd::~MemoryEtcd() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  dispatcher_.join();
}

Status MemoryEtcd::CheckAvailable() const {
  if (unavailable_) return Status::Unavailable("memory etcd: unavailable (test switch)");
  return Status::OK();
}

std::vector<KeyValue> MemoryEtcd::RangeLocked(const std::string& key,
                                              const RangeOptions& o) const {
  std::vector<KeyValue> out;
  auto add = [&](const KeyValue& kv) {
    if (o.min_create_revision && kv.create_revision < o.min_create_revision) return;
    if (o.max_create_revision && kv.create_revision > o.max_create_revision) return;
    if (o.min_mod_revision && kv.mod_revision < o.min_mod_revision) return;
    if (o.max_mod_revision && kv.mod_revision > o.max_mod_revision) return;
    out.push_back(kv);
  };
  if (o.prefix) {
    for (auto it = kvs_.lower_bound(key); it != kvs_.end() && it->first.starts_with(key); ++it) {
      add(it->second);
    }
  } else if (auto it = kvs_.find(key); it != kvs_.end()) {
    add(it->second);
  }
  using SO = RangeOptions::SortOrder;
  using ST = RangeOptions::SortTarget;
  if (o.sort_order != SO::kNone) {
    auto field = [&](const KeyValue& kv) -> int64_t {
      switch (o.sort_target) {
        case ST::kVersion: return kv.version;
        case ST::kCreateRevision: return kv.create_revision;
        case ST::kModRevision: return kv.mod_revision;
        default: return 0;
      }
    };
    std::stable_sort(out.begin(), out.end(), [&](const KeyValue& a, const KeyValue& b) {
      bool less;
      if (o.sort_target == ST::kKey) {
        less = a.key < b.key;
      } else if (o.sort_target == ST::kValue) {
        less = a.value < b.value;
      } else {
        less = field(a) < field(b);
      }
      bool greater;
      if (o.sort_target == ST::kKey) {
        greater = b.key < a.key;
      } else if (o.sort_target == ST::kValue) {
        greater = b.value < a.value;
      } else {
        greater = field(b) < field(a);
      }
      return o.sort_order == SO::kAscend ? less : greater;
    });
  }
  return out;
}

Result<etcd::RangeResult> MemoryEtcd::Range(const std::string& key, const RangeOptions& options) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.ranges;
  if (options.revision != 0) {
    return Status::Unavailable("memory etcd: ranges at a past revision are not modelled");
  }
  etcd::RangeResult r;
  r.kvs = RangeLocked(key, options);
  r.count = static_cast<int64_t>(r.kvs.size());
  r.revision = revision_;
  if (options.limit > 0 && r.count > options.limit) {
    r.kvs.resize(static_cast<size_t>(options.limit));
    r.more = true;
  }
  if (options.count_only) r.kvs.clear();
  for (auto& kv : r.kvs) {
    if (options.keys_only) kv.value.clear();
    stats_.bytes_read += static_cast<int64_t>(kv.key.size() + kv.value.size());
  }
  return r;
}

Result<std::optional<KeyValue>> MemoryEtcd::Get(const std::string& key) {
  EFDL_ASSIGN_OR_RETURN(etcd::RangeResult r, Range(key));
  if (r.kvs.empty()) return std::optional<KeyValue>();
  return std::optional<KeyValue>(std::move(r.kvs.front()));
}

void MemoryEtcd::PutLocked(const std::string& key, const std::string& value, int64_t lease,
                           int64_t revision, std::vector<WatchEvent>& events) {
  KeyValue& kv = kvs_[key];
  if (kv.version == 0) {
    kv.key = key;
    kv.create_revision = revision;
  }
  if (kv.lease != 0 && kv.lease != lease) {
    if (auto it = leases_.find(kv.lease); it != leases_.end()) it->second.keys.erase(key);
  }
  kv.value = value;
  kv.mod_revision = revision;
  ++kv.version;
  kv.lease = lease;
  if (lease != 0) leases_[lease].keys.insert(key);
  stats_.bytes_written += static_cast<int64_t>(key.size() + value.size());
  events.push_back({WatchEvent::Type::kPut, kv});
}

int64_t MemoryEtcd::DeleteLocked(const std::string& key, bool prefix, int64_t revision,
                                 std::vector<WatchEvent>& events) {
  std::vector<std::string> doomed;
  if (prefix) {
    for (auto it = kvs_.lower_bound(key); it != kvs_.end() && it->first.starts_with(key); ++it) {
      doomed.push_back(it->first);
    }
  } else if (kvs_.count(key)) {
    doomed.push_back(key);
  }
  for (const auto& k : doomed) {
    auto it = kvs_.find(k);
    if (it->second.lease != 0) {
      if (auto l = leases_.find(it->second.lease); l != leases_.end()) l->second.keys.erase(k);
    }
    WatchEvent e;
    e.type = WatchEvent::Type::kDelete;
    e.kv.key = k;
    e.kv.mod_revision = revision;
    events.push_back(std::move(e));
    kvs_.erase(it);
  }
  return static_cast<int64_t>(doomed.size());
}

void MemoryEtcd::PublishLocked(int64_t revision, const std::vector<WatchEvent>& events) {
  if (events.empty()) return;
  for (const auto& e : events) history_.emplace_back(revision, e);
  for (const auto& [id, w] : watches_) {
    etcd::WatchUpdate u;
    u.revision = revision;
    for (const auto& e : events) {
      if (Matches(w, e.kv.key)) u.events.push_back(e);
    }
    if (!u.events.empty()) queue_.push_back({id, std::move(u), {}});
  }
  cv_.notify_all();
}

Result<etcd::PutResult> MemoryEtcd::Put(const std::string& key, const std::string& value,
                                        int64_t lease) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.puts;
  if (lease != 0 && !leases_.count(lease)) {
    return Status::NotFound(fmt::format("memory etcd: lease {:x} not found", lease));
  }
  std::vector<WatchEvent> events;
  int64_t rev = ++revision_;
  PutLocked(key, value, lease, rev, events);
  PublishLocked(rev, events);
  return etcd::PutResult{rev};
}

Result<etcd::DeleteResult> MemoryEtcd::Delete(const std::string& key, bool prefix) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.deletes;
  std::vector<WatchEvent> events;
  int64_t deleted = DeleteLocked(key, prefix, revision_ + 1, events);
  if (deleted > 0) {
    ++revision_;
    PublishLocked(revision_, events);
  }
  return etcd::DeleteResult{deleted, revision_};
}

bool MemoryEtcd::CompareHolds(const Compare& c) const {
  auto it = kvs_.find(c.key);
  const KeyValue* kv = it == kvs_.end() ? nullptr : &it->second;
  if (c.target == Compare::Target::kValue) {
    if (kv == nullptr) return false;  // etcd: a value compare on a missing key fails
    int cmp = kv->value.compare(c.value);
    switch (c.op) {
      case Compare::Op::kEqual: return cmp == 0;
      case Compare::Op::kNotEqual: return cmp != 0;
      case Compare::Op::kGreater: return cmp > 0;
      case Compare::Op::kLess: return cmp < 0;
    }
    return false;
  }
  int64_t have = 0;
  if (kv != nullptr) {
    switch (c.target) {
      case Compare::Target::kVersion: have = kv->version; break;
      case Compare::Target::kCreateRevision: have = kv->create_revision; break;
      case Compare::Target::kModRevision: have = kv->mod_revision; break;
      case Compare::Target::kValue: break;
    }
  }
  switch (c.op) {
    case Compare::Op::kEqual: return have == c.number;
    case Compare::Op::kNotEqual: return have != c.number;
    case Compare::Op::kGreater: return have > c.number;
    case Compare::Op::kLess: return have < c.number;
  }
  return false;
}

Result<etcd::TxnResult> MemoryEtcd::Txn(const std::vector<Compare>& compares,
                                        const std::vector<TxnOp>& then,
                                        const std::vector<TxnOp>& otherwise) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.txns;
  constexpr size_t kMaxTxnOps = 128;  // etcd's default --max-txn-ops
  if (compares.size() > kMaxTxnOps || then.size() > kMaxTxnOps || otherwise.size() > kMaxTxnOps) {
    return Status::InvalidArgument("memory etcd: too many operations in txn request (max 128)");
  }
  etcd::TxnResult result;
  result.succeeded = std::all_of(compares.begin(), compares.end(),
                                 [&](const Compare& c) { return CompareHolds(c); });
  const auto& ops = result.succeeded ? then : otherwise;
  for (const auto& op : ops) {
    if (op.type == TxnOp::Type::kPut && op.lease != 0 && !leases_.count(op.lease)) {
      return Status::NotFound(fmt::format("memory etcd: lease {:x} not found", op.lease));
    }
  }
  bool writes = std::any_of(ops.begin(), ops.end(),
                            [](const TxnOp& op) { return op.type != TxnOp::Type::kGet; });
  int64_t rev = writes ? revision_ + 1 : revision_;
  std::vector<WatchEvent> events;
  for (const auto& op : ops) {
    switch (op.type) {
      case TxnOp::Type::kPut: PutLocked(op.key, op.value, op.lease, rev, events); break;
      case TxnOp::Type::kDelete: DeleteLocked(op.key, op.prefix, rev, events); break;
      case TxnOp::Type::kGet: {
        RangeOptions ro;
        ro.prefix = op.prefix;
        etcd::RangeResult r;
        r.kvs = RangeLocked(op.key, ro);
        r.count = static_cast<int64_t>(r.kvs.size());
        r.revision = rev;
        for (const auto& kv : r.kvs) {
          stats_.bytes_read += static_cast<int64_t>(kv.key.size() + kv.value.size());
        }
        result.gets.push_back(std::move(r));
        break;
      }
    }
  }
  if (writes) {
    revision_ = rev;
    PublishLocked(rev, events);
  }
  result.revision = revision_;
  return result;
}

Result<etcd::LeaseGrantResult> MemoryEtcd::LeaseGrant(int64_t ttl_seconds) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  if (ttl_seconds <= 0) return Status::InvalidArgument("memory etcd: lease TTL must be positive");
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.lease_grants;
  int64_t id = next_lease_++;
  LeaseState& l = leases_[id];
  l.ttl_seconds = ttl_seconds;
  l.deadline = clock_() + std::chrono::seconds(ttl_seconds);
  return etcd::LeaseGrantResult{id, ttl_seconds};
}

void MemoryEtcd::EndLeaseLocked(int64_t lease_id) {
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return;
  std::vector<std::string> keys(it->second.keys.begin(), it->second.keys.end());
  leases_.erase(it);
  if (!keys.empty()) {
    int64_t rev = ++revision_;
    std::vector<WatchEvent> events;
    for (const auto& k : keys) DeleteLocked(k, false, rev, events);
    PublishLocked(rev, events);
  }
  for (auto& [id, k] : keepers_) {
    if (k.lease_id == lease_id && !k.fired && k.on_lost) {
      k.fired = true;
      queue_.push_back({0, {}, k.on_lost});
    }
  }
  cv_.notify_all();
}

Status MemoryEtcd::LeaseRevoke(int64_t lease_id) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.lease_revokes;
  if (!leases_.count(lease_id)) {
    return Status::NotFound(fmt::format("memory etcd: lease {:x} not found", lease_id));
  }
  EndLeaseLocked(lease_id);
  return Status::OK();
}

Result<int64_t> MemoryEtcd::LeaseTimeToLive(int64_t lease_id) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return Status::NotFound(fmt::format("memory etcd: lease {:x} not found", lease_id));
  }
  auto left = std::chrono::duration_cast<std::chrono::seconds>(it->second.deadline - clock_());
  return std::max<int64_t>(0, left.count());
}

Result<std::unique_ptr<etcd::LeaseKeeper>> MemoryEtcd::KeepAlive(int64_t lease_id,
                                                                 std::function<void()> on_lost) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return Status::NotFound(fmt::format("memory etcd: lease {:x} not found", lease_id));
  }
  ++it->second.keepers;
  int64_t keeper_id = next_keeper_++;
  keepers_[keeper_id] = {lease_id, std::move(on_lost), false};
  return std::unique_ptr<etcd::LeaseKeeper>(new KeeperHandle(this, keeper_id, lease_id));
}

void MemoryEtcd::ReleaseKeeper(int64_t keeper_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = keepers_.find(keeper_id);
  if (it == keepers_.end()) return;
  if (auto l = leases_.find(it->second.lease_id); l != leases_.end()) --l->second.keepers;
  keepers_.erase(it);
}

void MemoryEtcd::RefreshKeptLeasesLocked() {
  auto now = clock_();
  for (auto& [id, l] : leases_) {
    if (l.keepers > 0 && !l.paused) l.deadline = now + std::chrono::seconds(l.ttl_seconds);
  }
}

void MemoryEtcd::Expire(int64_t lease_id) {
  std::lock_guard<std::mutex> lock(mu_);
  EndLeaseLocked(lease_id);
}

void MemoryEtcd::PauseKeepAlive(int64_t lease_id, bool paused) {
  std::lock_guard<std::mutex> lock(mu_);
  RefreshKeptLeasesLocked();  // the deadline counts from the last renewal before the pause
  if (auto it = leases_.find(lease_id); it != leases_.end()) it->second.paused = paused;
}

void MemoryEtcd::ExpireDueLeases() {
  std::lock_guard<std::mutex> lock(mu_);
  RefreshKeptLeasesLocked();
  auto now = clock_();
  std::vector<int64_t> due;
  for (const auto& [id, l] : leases_) {
    if (l.deadline <= now) due.push_back(id);
  }
  for (int64_t id : due) EndLeaseLocked(id);
}

bool MemoryEtcd::Matches(const WatchState& w, const std::string& key) const {
  return w.prefix ? key.starts_with(w.key) : key == w.key;
}

Result<std::unique_ptr<etcd::Watch>> MemoryEtcd::StartWatch(const std::string& key,
                                                            const etcd::WatchOptions& options,
                                                            etcd::WatchCallback callback) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.watches_started;
  int64_t id = next_watch_++;
  WatchState& w = watches_[id];
  w.key = key;
  w.prefix = options.prefix;
  w.callback = std::move(callback);
  if (options.start_revision != 0 && options.start_revision <= revision_) {
    if (options.start_revision < compact_revision_) {
      etcd::WatchUpdate u;
      u.revision = revision_;
      u.compacted = true;
      u.compact_revision = compact_revision_;
      queue_.push_back({id, std::move(u), {}});
    } else {
      // Replay history, one update per revision, as etcd sends it.
      etcd::WatchUpdate u;
      for (const auto& [rev, e] : history_) {
        if (rev < options.start_revision || !Matches(w, e.kv.key)) continue;
        if (!u.events.empty() && u.revision != rev) {
          queue_.push_back({id, std::move(u), {}});
          u = {};
        }
        u.revision = rev;
        u.events.push_back(e);
      }
      if (!u.events.empty()) queue_.push_back({id, std::move(u), {}});
    }
    cv_.notify_all();
  }
  return std::unique_ptr<etcd::Watch>(new WatchHandle(this, id));
}

void MemoryEtcd::CancelWatch(int64_t watch_id) {
  std::unique_lock<std::mutex> lock(mu_);
  watches_.erase(watch_id);
  std::erase_if(queue_, [&](const Delivery& d) { return d.watch_id == watch_id; });
  // The contract: after cancellation returns the callback is not running (unless we are that
  // callback, cancelling itself from the dispatcher thread).
  if (std::this_thread::get_id() != dispatcher_id_) {
    cv_.wait(lock, [&] { return running_watch_ != watch_id; });
  }
}

Status MemoryEtcd::Compact(int64_t revision) {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  if (revision > revision_) {
    return Status::InvalidArgument("memory etcd: compaction revision is in the future");
  }
  compact_revision_ = std::max(compact_revision_, revision);
  std::erase_if(history_, [&](const auto& h) { return h.first < compact_revision_; });
  return Status::OK();
}

Result<int64_t> MemoryEtcd::CurrentRevision() {
  EFDL_RETURN_IF_ERROR(CheckAvailable());
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.ranges;
  return revision_;
}

MemoryEtcd::Stats MemoryEtcd::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void MemoryEtcd::ResetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = {};
}

bool MemoryEtcd::WaitIdle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return queue_.empty() && !dispatching_; });
}

void MemoryEtcd::DispatchLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  dispatcher_id_ = std::this_thread::get_id();
  auto next_expiry_check = clock_();
  while (!stop_) {
    if (queue_.empty()) {
      cv_.wait_for(lock, std::chrono::milliseconds(20));
      if (clock_() >= next_expiry_check) {
        lock.unlock();
        ExpireDueLeases();
        lock.lock();
        next_expiry_check = clock_() + std::chrono::milliseconds(20);
      }
      continue;
    }
    Delivery d = std::move(queue_.front());
    queue_.pop_front();
    etcd::WatchCallback callback;
    if (d.watch_id != 0) {
      auto it = watches_.find(d.watch_id);
      if (it == watches_.end()) continue;
      callback = it->second.callback;  // a copy: the watch may be cancelled while it runs
      running_watch_ = d.watch_id;
      stats_.watch_events += static_cast<int64_t>(d.update.events.size());
      for (const auto& e : d.update.events) {
        stats_.bytes_read += static_cast<int64_t>(e.kv.key.size() + e.kv.value.size());
      }
    }
    dispatching_ = true;
    lock.unlock();
    if (d.watch_id != 0) {
      callback(d.update);
    } else if (d.task) {
      d.task();
    }
    lock.lock();
    dispatching_ = false;
    running_watch_ = 0;
    cv_.notify_all();
  }
}

}  // namespace efdl::testing
