// The environment of a worker (WorkerEnvironment) and of a --launcher process
// (LauncherEnvironment), declared in agent.h: torchrun's variables, EFDL's, Horovod's and the
// socket interface for gloo/NCCL.
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "agent/agent.h"
#include "common/env_names.h"
#include "health/progress_board.h"
#include "horovod/rendezvous_server.h"
#include "horovod/slots.h"

namespace efdl::agent {

namespace {

// What Horovod's Gloo controller reads when started without horovodrun (docs/horovod.md). The
// node id is the host name: unique in the job, so each node gets its own local_<host> scope
// even when several nodes share a machine.
void AddHorovodEnvironment(const AgentOptions& options, const rdzv::Assignment& a,
                           int local_rank, std::map<std::string, std::string>& env) {
  const auto li = static_cast<size_t>(local_rank);
  horovod::SlotInfo slot;
  slot.hostname = options.node_id;
  slot.rank = a.rank_offset + local_rank;
  slot.size = a.world_size;
  slot.local_rank = local_rank;
  slot.local_size = a.nproc;
  // Without a per-local-rank layout every node runs the same number of processes.
  slot.cross_rank = li < a.cross_rank.size() ? a.cross_rank[li] : a.node_rank;
  slot.cross_size = li < a.cross_size.size() ? a.cross_size[li] : a.nnodes;
  horovod::WorkerEnvOptions o;
  o.rendezvous_addr = a.master_addr;
  o.rendezvous_port = a.horovod_port;
  // No secret, no token: the address is left out and EFDL's layer says why (fail closed).
  if (auto token = horovod::RendezvousToken(options.job_secret, a.round); token.ok()) {
    o.rendezvous_token = std::move(token).value();
  }
  // A value the user set in the agent's environment reaches the worker unchanged.
  if (std::getenv(envvar::kHorovodGlooIface) == nullptr) o.gloo_iface = options.gloo_iface;
  env.merge(horovod::WorkerEnv(slot, o));
}

// gloo and NCCL find their own address by resolving the host name unless told an interface,
// and a Debian/Ubuntu host maps its own name to 127.0.1.1: the peers would be told to connect
// there. Name the interface of the advertise address instead (docs/operations.md,
// "Networking"), unless the user set the variable in the agent's environment.
void AddSocketInterface(const AgentOptions& options, std::map<std::string, std::string>& env) {
  if (options.gloo_iface.empty()) return;
  for (const char* name : {envvar::kGlooSocketIfname, envvar::kNcclSocketIfname}) {
    if (std::getenv(name) == nullptr) env[name] = options.gloo_iface;
  }
}

// What a worker and a --launcher process both get: the job's ids and the round, the snapshot
// directory, the thread count and the socket interface.
void AddCommon(const AgentOptions& options, const rdzv::Assignment& a, int restart_count,
               const std::string& arena_holder, std::map<std::string, std::string>& env) {
  env[envvar::kJobId] = options.job_id;
  // The agent's arena holder lock (snapshot/holder_lock.h): which agent's arenas these are.
  if (!arena_holder.empty()) env[envvar::kArenaHolder] = arena_holder;
  env[envvar::kNodeId] = options.node_id;
  env[envvar::kRound] = std::to_string(a.round);
  env[envvar::kRestartCount] = std::to_string(restart_count);
  env[envvar::kNumMinWorkers] = std::to_string(options.min_nodes);
  env[envvar::kNumMaxWorkers] = std::to_string(options.max_nodes);
  env[envvar::kSnapshotDir] = options.snapshot_dir;
  // As torchrun does: several processes per node must not each spawn a thread per core.
  if (a.nproc > 1 && std::getenv(envvar::kOmpNumThreads) == nullptr) {
    env[envvar::kOmpNumThreads] = "1";
  }
  AddSocketInterface(options, env);
  // --horovod: `import horovod` finds EFDL's stand-in first (docs/horovod.md), whose layer is
  // the one EFDL_HOROVOD=torch chooses.
  if (!options.horovod_shim_dir.empty()) {
    const char* path = std::getenv(envvar::kPythonPath);
    env[envvar::kPythonPath] = options.horovod_shim_dir +
                               (path != nullptr && *path != '\0' ? ":" + std::string(path) : "");
    env[envvar::kHorovod] = "torch";
  }
}

}  // namespace

std::map<std::string, std::string> WorkerEnvironment(const AgentOptions& options,
                                                     const rdzv::Assignment& a, int local_rank,
                                                     int restart_count,
                                                     const std::string& control_socket,
                                                     const std::string& arena_holder) {
  const int rank = a.rank_offset + local_rank;
  std::map<std::string, std::string> env = {
      {envvar::kRank, std::to_string(rank)},
      {envvar::kLocalRank, std::to_string(local_rank)},
      {envvar::kWorldSize, std::to_string(a.world_size)},
      {envvar::kLocalWorldSize, std::to_string(a.nproc)},
      {envvar::kGroupRank, std::to_string(a.node_rank)},
      {envvar::kNodeRank, std::to_string(a.node_rank)},
      {envvar::kNnodes, std::to_string(a.nnodes)},
      {envvar::kNprocPerNode, std::to_string(a.nproc)},
      {envvar::kGroupWorldSize, std::to_string(a.nnodes)},
      {envvar::kRoleName, "default"},
      {envvar::kRoleRank, std::to_string(rank)},
      {envvar::kRoleWorldSize, std::to_string(a.world_size)},
      {envvar::kMasterAddr, a.master_addr},
      {envvar::kMasterPort, std::to_string(a.master_port)},
      {envvar::kControlSocket, control_socket},
      // torch 1.13 keeps a round's keys apart in an agent store under this count's prefix, so it
      // must then be the same on every worker of the round: the round number.
      {envvar::kTorchelasticRestartCount, std::to_string(a.agent_store ? a.round : restart_count)},
      {envvar::kTorchelasticMaxRestarts, std::to_string(options.max_restarts)},
      {envvar::kTorchelasticRunId, options.job_id},
      // "True": MASTER_PORT is the rank-0 node's agent store and every rank, rank 0 included,
      // connects to it as a client (torch.distributed's env:// handler reads this).
      {envvar::kTorchelasticUseAgentStore, a.agent_store ? "True" : "False"},
  };
  if (!options.job_secret.empty()) env[envvar::kJobSecret] = options.job_secret;
  // Hang detection (src/health): the progress board and the stacks live in the agent's own
  // directory, beside its control socket (agent_health.cc creates the board there).
  if (HangDetectionOn(options) && !control_socket.empty()) {
    const std::string dir = std::filesystem::path(control_socket).parent_path().string();
    env[health::kBoardEnv] = dir + "/" + health::kBoardFile;
    env[health::kSlotEnv] = std::to_string(local_rank);
    env[health::kStackDirEnv] = dir;
    env[health::kStackSignalEnv] = std::to_string(health::kStackSignal);
  }
  // The agent's AgentPersister writes storage; the workers only commit to shared memory.
  if (!options.snapshot_dir.empty()) env[envvar::kAgentPersists] = "1";
  // The job's records live in a shared etcd (--etcd): starting it over needs `efdl reset --etcd`.
  if (options.shared_etcd) env[envvar::kSharedEtcd] = "1";
  AddCommon(options, a, restart_count, arena_holder, env);
  AddHorovodEnvironment(options, a, local_rank, env);
  return env;
}

std::map<std::string, std::string> LauncherEnvironment(const AgentOptions& options,
                                                       const rdzv::Assignment& a,
                                                       int restart_count,
                                                       const std::string& arena_holder) {
  std::map<std::string, std::string> env = {
      {envvar::kNnodes, std::to_string(a.nnodes)},
      {envvar::kNodeRank, std::to_string(a.node_rank)},
      {envvar::kNprocPerNode, std::to_string(a.nproc)},
      {envvar::kMasterAddr, a.master_addr},
      {envvar::kMasterPort, std::to_string(a.master_port)},
      {envvar::kWorldSize, std::to_string(a.world_size)},
      {envvar::kRank, std::to_string(a.rank_offset)},
      // Recipes written for one process per GPU gate the launch on local rank 0.
      {envvar::kLocalRank, "0"},
      {envvar::kLauncher, "1"},
  };
  AddCommon(options, a, restart_count, arena_holder, env);
  return env;
}

}  // namespace efdl::agent
