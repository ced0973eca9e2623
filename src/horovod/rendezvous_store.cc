#include "horovod/rendezvous_store.h"

namespace efdl::horovod {

void RendezvousStore::Reset(const std::vector<SlotInfo>& round) {
  MutexLock lock(mu_);
  data_.clear();
  finished_.clear();
  scope_size_.clear();
  slot_by_host_rank_.clear();
  for (const auto& s : round) {
    scope_size_["global"] = s.size;
    scope_size_["local_" + s.hostname] = s.local_size;
    scope_size_["cross_" + std::to_string(s.local_rank)] = s.cross_size;
    slot_by_host_rank_[s.hostname + ":" + std::to_string(s.local_rank)] = s;
  }
}

std::optional<std::string> RendezvousStore::Get(const std::string& scope,
                                                const std::string& key) const {
  MutexLock lock(mu_);
  if (scope == kRankAndSizeScope) {
    // Horovod answers a worker it does not know (removed host, extra local rank) with -1s, not
    // 404: the worker must stop polling and fail with "removed from the job".
    auto it = slot_by_host_rank_.find(key);
    return (it == slot_by_host_rank_.end() ? RemovedSlot() : it->second).ToResponseString();
  }
  auto s = data_.find(scope);
  if (s == data_.end()) return std::nullopt;
  auto k = s->second.find(key);
  if (k == s->second.end()) return std::nullopt;
  return k->second;
}

void RendezvousStore::Put(const std::string& scope, const std::string& key, std::string value) {
  MutexLock lock(mu_);
  data_[scope][key] = std::move(value);
}

void RendezvousStore::Delete(const std::string& scope, const std::string& key) {
  MutexLock lock(mu_);
  auto size = scope_size_.find(scope);
  if (size != scope_size_.end()) {
    // A set, not a list: a client that retries its DELETE must not count twice.
    auto& done = finished_[scope];
    done.insert(key);
    if (static_cast<int>(done.size()) >= size->second) {
      data_.erase(scope);
      finished_.erase(scope);
    }
    return;
  }
  auto s = data_.find(scope);
  if (s == data_.end()) return;
  s->second.erase(key);
  if (s->second.empty()) data_.erase(s);
}

size_t RendezvousStore::KeyCount(const std::string& scope) const {
  MutexLock lock(mu_);
  auto s = data_.find(scope);
  return s == data_.end() ? 0 : s->second.size();
}

std::optional<int> RendezvousStore::ScopeSize(const std::string& scope) const {
  MutexLock lock(mu_);
  auto it = scope_size_.find(scope);
  if (it == scope_size_.end()) return std::nullopt;
  return it->second;
}

}  // namespace efdl::horovod
