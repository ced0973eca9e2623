// The coordinator of a job, as one node runs it while the round record names it (protocol.h):
// it watches nodes/ and ack/, keeps a JobView, and carries out the decisions of coordination.h
// in etcd (proposals, assignments, the active and complete records, standbys, the status key).
//
// Threading: used only by the node's driver thread (EtcdRendezvous), like everything it calls
// back through CoordinatorHost. Its watches deliver through the host, which queues them.
// Finalize sends the assignment txns from up to 8 threads of its own (the client only), joined
// before it returns.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "rendezvous/coordination.h"
#include "rendezvous/protocol.h"

namespace efdl::rdzv {

// What the coordinator needs of the node that runs it.
class CoordinatorHost {
 public:
  virtual ~CoordinatorHost() = default;
  // The round record as the node last applied it, and its mod revision in etcd.
  virtual const RoundRecord& round() const = 0;
  virtual int64_t round_revision() const = 0;
  // Writes `rec` if the round key is still at round_revision(), and applies it; false if the
  // CAS was lost or etcd failed (the caller then re-reads).
  virtual bool CasRound(const RoundRecord& rec) = 0;
  virtual void RereadRound() = 0;
  // Applies a record the coordinator wrote in a transaction of its own, at `mod_revision`.
  virtual void ApplyRound(const RoundRecord& rec, int64_t mod_revision) = 0;
  // A watch callback that queues the watch's updates for OnNodesEvents/OnAckEvents (or, when
  // the watch breaks, a restart of coordination) under `generation`.
  virtual etcd::WatchCallback CoordinatorWatch(bool nodes, uint64_t generation) = 0;
  // The job could not be read: resynchronise the node with etcd.
  virtual void RequestResync() = 0;
};

class Coordinator {
 public:
  Coordinator(etcd::Client& client, const JobKeys& keys, CoordinatorConfig config,
              CoordinatorHost& host)
      : client_(client), keys_(keys), cfg_(std::move(config)), host_(host) {}

  // Reads the job (one txn), starts the watches and begins coordinating; on an etcd error asks
  // the host for a resync and stays inactive.
  void Start();
  void Stop();
  bool active() const { return active_; }
  // Bumped at every Start/Stop: watch updates of another generation are stale.
  uint64_t generation() const { return generation_; }

  void OnNodesEvents(const std::vector<etcd::WatchEvent>& events);
  void OnAckEvents(const std::vector<etcd::WatchEvent>& events);
  // Decides and acts after a batch of inputs or at a deadline.
  void Step(CoordTime now);
  std::optional<CoordTime> NextDeadline() const;

 private:
  void Execute(const EventOutcome& outcome);
  void Propose(bool graceful, const std::string& why);
  void Finalize();
  void CompleteJob();
  void AssignStandby(const std::string& id);
  void SetDeputies(std::vector<std::string> deputies);
  void Record(const std::string& message);
  void WriteStatus();

  etcd::Client& client_;
  const JobKeys& keys_;
  const CoordinatorConfig cfg_;
  CoordinatorHost& host_;
  bool active_ = false;
  // Standbys were assigned since the status was last written: Step writes it once for all of
  // them (the status is O(N) bytes; one write per standby made a batch of joins at MAX O(N^2)).
  bool status_stale_ = false;
  uint64_t generation_ = 0;
  std::unique_ptr<etcd::Watch> nodes_watch_, acks_watch_;
  JobView view_;
  std::deque<nlohmann::json> history_;   // the status key's recent events
};

}  // namespace efdl::rdzv
