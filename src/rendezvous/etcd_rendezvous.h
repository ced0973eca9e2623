// The Rendezvous over etcd (the protocol of protocol.h). Only the code that builds an agent
// (`efdl run`, `efdl sim`, tests) includes this: the agent itself sees the Rendezvous interface
// alone, not the etcd client.
#pragma once

#include <memory>

#include "efdl/etcd.h"
#include "rendezvous/rendezvous.h"

namespace efdl::rdzv {
class DriverPool;
}

namespace efdl::rdzv {

// `client` must outlive the returned object. The protocol is described in
// src/rendezvous/protocol.h. Destroying the object leaves the job (as Leave()).
// kRoundStarted with assignment.standby = true means: registered, but the job is at MAX; start
// no workers and wait for the next event.
//
// `pool` (optional, must outlive the object): run the node's driver steps on that shared pool
// instead of a thread of its own; `efdl sim` drives thousands of nodes this way (driver_pool.h).
std::unique_ptr<Rendezvous> NewEtcdRendezvous(etcd::Client& client, RendezvousOptions options,
                                              DriverPool* pool = nullptr);

}  // namespace efdl::rdzv
