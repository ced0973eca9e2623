// The key-value state behind Horovod's Gloo rendezvous, without the HTTP around it.
//
// Values live in scopes ("global", "local_<host>", "cross_<local rank>", or any other name a
// client uses). A scope whose size the round defines is cleared once that many distinct ranks
// have DELETEd their rank in it (each rank does so after its context's barrier); in other
// ("ad-hoc") scopes a DELETE removes that one key. The reserved scope "rank_and_size" answers
// "<host>:<local rank>" from the round's assignment.
//
// Thread-safe: all methods may be called concurrently.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "horovod/slots.h"

namespace efdl::horovod {

class RendezvousStore {
 public:
  static constexpr const char* kRankAndSizeScope = "rank_and_size";

  RendezvousStore() = default;
  explicit RendezvousStore(const std::vector<SlotInfo>& round) { Reset(round); }

  // Starts a new round: forgets every value and DELETE, takes the scope sizes from `round`.
  void Reset(const std::vector<SlotInfo>& round);

  // nullopt when the key is absent (HTTP 404).
  std::optional<std::string> Get(const std::string& scope, const std::string& key) const;
  void Put(const std::string& scope, const std::string& key, std::string value);
  // Records that rank `key` is done with `scope` (see the header comment).
  void Delete(const std::string& scope, const std::string& key);

  // How many keys `scope` holds now; for diagnostics and tests.
  size_t KeyCount(const std::string& scope) const;
  // The size the round gives `scope`, or nullopt for an ad-hoc scope.
  std::optional<int> ScopeSize(const std::string& scope) const;

 private:
  mutable Mutex mu_;
  std::map<std::string, std::map<std::string, std::string>> data_ EFDL_GUARDED_BY(mu_);
  std::map<std::string, int> scope_size_ EFDL_GUARDED_BY(mu_);
  std::map<std::string, std::set<std::string>> finished_ EFDL_GUARDED_BY(mu_);
  std::map<std::string, SlotInfo> slot_by_host_rank_ EFDL_GUARDED_BY(mu_);
};

}  // namespace efdl::horovod
