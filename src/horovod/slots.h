// Horovod's view of one EFDL round: which rank, local rank and cross rank every worker process
// has, and the HOROVOD_* environment a worker started without horovodrun needs.
//
// Pure functions, no I/O. The numbering follows Horovod's gloo runner: hosts in round order,
// global ranks contiguous per host; the cross communicator of local rank i holds local rank i of
// every host that has more than i processes, numbered in host order.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "efdl/status.h"

namespace efdl::horovod {

// One host (an EFDL node) of the round and its number of worker processes.
struct HostSlots {
  // Becomes HOROVOD_HOSTNAME and the name of the host's `local_<hostname>` scope, so it must be
  // unique in the round. Use the EFDL node id, not the machine's host name: several nodes may
  // run on one machine and each must get its own local scope.
  std::string hostname;
  int slots = 0;
};

// Where one worker process stands; the fields of Horovod's rank_and_size answer.
struct SlotInfo {
  std::string hostname;
  int rank = 0;
  int size = 0;
  int local_rank = 0;
  int local_size = 0;
  int cross_rank = 0;
  int cross_size = 0;

  // "rank,size,local_rank,local_size,cross_rank,cross_size", the elastic GET answer.
  std::string ToResponseString() const;
  friend bool operator==(const SlotInfo&, const SlotInfo&) = default;
};

// The answer Horovod gives a process that is not part of the round: every field -1.
SlotInfo RemovedSlot();

// Checks that `hostname` can name a scope in a URL path ("local_<hostname>") and a
// rank_and_size key ("<hostname>:<local_rank>"): non-empty, at most 253 characters of
// [A-Za-z0-9._-].
Status ValidateHostname(const std::string& hostname);

// Every process of the round, host by host in the given order. Fails on an empty round, a host
// with fewer than 1 slot, an invalid or duplicate host name.
Result<std::vector<SlotInfo>> AssignSlots(const std::vector<HostSlots>& hosts);

struct WorkerEnvOptions {
  std::string rendezvous_addr;   // where the round's RendezvousServer listens
  uint16_t rendezvous_port = 0;
  std::string rendezvous_token;  // the round's RendezvousToken (the server needs it)
  bool elastic = false;          // sets HOROVOD_ELASTIC=1 (re-init asks rank_and_size)
  std::string gloo_iface;        // HOROVOD_GLOO_IFACE when non-empty
  int gloo_timeout_seconds = 0;  // HOROVOD_GLOO_TIMEOUT_SECONDS when > 0
};

using EnvMap = std::map<std::string, std::string>;

// The HOROVOD_* variables of the one process `slot`. The rendezvous address and port are set
// only when the port is not 0 and there is a token (a worker without them cannot initialise
// real Horovod, and EFDL's Python layer says so); the address carries the token
// (HorovodAddrWithToken in rendezvous_server.h).
EnvMap WorkerEnv(const SlotInfo& slot, const WorkerEnvOptions& options);

// The HOROVOD_* variables for each local process (index = local rank) of hosts[host_index].
// Fails like AssignSlots, on a host_index out of range, and on an empty address, port 0 or an
// empty token.
Result<std::vector<EnvMap>> WorkerEnvForHost(const std::vector<HostSlots>& hosts,
                                             size_t host_index, const WorkerEnvOptions& options);

}  // namespace efdl::horovod
