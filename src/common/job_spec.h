// The identity of one node's part in a job, held once: `efdl run` fills it (cli/run_config.cc)
// and the agent's, the rendezvous's and the coordinator's options are each a JobSpec plus their
// own settings (agent/agent.h AgentOptions, rendezvous/rendezvous.h RendezvousOptions,
// rendezvous/coordination.h CoordinatorConfig). Also the one rule for ids and the one place that
// builds a job's etcd key prefix.
#pragma once

#include <string>
#include <string_view>

#include "efdl/status.h"

namespace efdl {

struct JobSpec {
  std::string job_id;
  std::string node_id;
  int nproc = 1;                       // worker processes on this node
  int min_nodes = 1;
  int max_nodes = 1;
  int world_size = 0;                  // >0: fragmented mode, the round's procs must sum to this
  std::string advertise_addr;          // host other nodes use to reach this node (MASTER_ADDR)
};

// Job ids and node ids become parts of etcd keys and file names: 1-128 of [A-Za-z0-9._-], not
// starting with '.' or '-' (docs/troubleshooting.md quotes the message). `what` names the id in
// the message ("job id", "node id").
Status ValidateId(std::string_view what, std::string_view id);

// Every etcd key of job `job_id` starts with this: "/efdl/<job>/".
std::string JobKeyPrefix(std::string_view job_id);

}  // namespace efdl
