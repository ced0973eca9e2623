// The Rendezvous over etcd (the protocol of protocol.h). Only the code that builds an agent
// (`efdl run`, `efdl sim`, tests) includes this: the agent itself sees the Rendezvous interface
// alone, not the etcd client.
#pragma once

#include <memory>

#include "efdl/etcd.h"
#include "rendezvous/rendezvous.h"

namespace efdl::rdzv {

// `client` must outlive the returned object. The protocol is described in
// src/rendezvous/protocol.h. Destroying the object leaves the job (as Leave()).
// kRoundStarted with assignment.standby = true means: registered, but the job is at MAX; start
// no workers and wait for the next event.
std::unique_ptr<Rendezvous> NewEtcdRendezvous(etcd::Client& client, RendezvousOptions options);

}  // namespace efdl::rdzv
