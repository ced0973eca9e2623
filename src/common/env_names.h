// The names of the environment variables EFDL's two languages share: the one owner (issue #31).
//
// Each name is declared once, in EFDL_ENV_NAMES below, as (C++ constant, Python name, value).
// C++ uses the constants (efdl::envvar::kJobId); Python gets the same table from the module the build
// generates from this header (python/efdl/_names.py, class Env: `Env.JOB_ID`; generator
// src/python/gen_names.cc), so neither language writes one of these names as a literal
// (tests/python/test_names.py checks the Python side). The launchers' own names (torchrun's,
// torch.distributed's, Horovod's) are part of the same contract and listed here too.
//
// What each variable means: docs/user-guide.md (the settings), docs/agent.md (a worker's
// environment), docs/snapshots.md (the snapshot settings).
#pragma once

// X(cpp_constant, PythonName, "VALUE")
#define EFDL_ENV_NAMES(X)                                                                       \
  /* a worker's place, as torchrun gives it (worker_env.cc; python/efdl/_env.py) */              \
  X(kRank, RANK, "RANK")                                                                        \
  X(kLocalRank, LOCAL_RANK, "LOCAL_RANK")                                                       \
  X(kWorldSize, WORLD_SIZE, "WORLD_SIZE")                                                       \
  X(kLocalWorldSize, LOCAL_WORLD_SIZE, "LOCAL_WORLD_SIZE")                                      \
  X(kGroupRank, GROUP_RANK, "GROUP_RANK")                                                       \
  X(kNodeRank, NODE_RANK, "NODE_RANK")                                                          \
  X(kNnodes, NNODES, "NNODES")                                                                  \
  X(kNprocPerNode, NPROC_PER_NODE, "NPROC_PER_NODE")                                            \
  X(kGroupWorldSize, GROUP_WORLD_SIZE, "GROUP_WORLD_SIZE")                                      \
  X(kRoleName, ROLE_NAME, "ROLE_NAME")                                                          \
  X(kRoleRank, ROLE_RANK, "ROLE_RANK")                                                          \
  X(kRoleWorldSize, ROLE_WORLD_SIZE, "ROLE_WORLD_SIZE")                                         \
  X(kMasterAddr, MASTER_ADDR, "MASTER_ADDR")                                                    \
  X(kMasterPort, MASTER_PORT, "MASTER_PORT")                                                    \
  X(kTorchelasticRestartCount, TORCHELASTIC_RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT")        \
  X(kTorchelasticMaxRestarts, TORCHELASTIC_MAX_RESTARTS, "TORCHELASTIC_MAX_RESTARTS")           \
  X(kTorchelasticRunId, TORCHELASTIC_RUN_ID, "TORCHELASTIC_RUN_ID")                             \
  X(kTorchelasticUseAgentStore, TORCHELASTIC_USE_AGENT_STORE, "TORCHELASTIC_USE_AGENT_STORE")   \
  /* what the agent sets besides (worker_env.cc) */                                            \
  X(kOmpNumThreads, OMP_NUM_THREADS, "OMP_NUM_THREADS")                                         \
  X(kGlooSocketIfname, GLOO_SOCKET_IFNAME, "GLOO_SOCKET_IFNAME")                                \
  X(kNcclSocketIfname, NCCL_SOCKET_IFNAME, "NCCL_SOCKET_IFNAME")                                \
  X(kPythonPath, PYTHONPATH, "PYTHONPATH")                                                      \
  /* Horovod's (src/horovod/slots.cc; python/efdl/backend/horovod) */                           \
  X(kHorovodHostname, HOROVOD_HOSTNAME, "HOROVOD_HOSTNAME")                                     \
  X(kHorovodRank, HOROVOD_RANK, "HOROVOD_RANK")                                                 \
  X(kHorovodSize, HOROVOD_SIZE, "HOROVOD_SIZE")                                                 \
  X(kHorovodLocalRank, HOROVOD_LOCAL_RANK, "HOROVOD_LOCAL_RANK")                                \
  X(kHorovodLocalSize, HOROVOD_LOCAL_SIZE, "HOROVOD_LOCAL_SIZE")                                \
  X(kHorovodCrossRank, HOROVOD_CROSS_RANK, "HOROVOD_CROSS_RANK")                                \
  X(kHorovodCrossSize, HOROVOD_CROSS_SIZE, "HOROVOD_CROSS_SIZE")                                \
  X(kHorovodController, HOROVOD_CONTROLLER, "HOROVOD_CONTROLLER")                               \
  X(kHorovodCpuOperations, HOROVOD_CPU_OPERATIONS, "HOROVOD_CPU_OPERATIONS")                    \
  X(kHorovodGlooRendezvousAddr, HOROVOD_GLOO_RENDEZVOUS_ADDR, "HOROVOD_GLOO_RENDEZVOUS_ADDR")   \
  X(kHorovodGlooRendezvousPort, HOROVOD_GLOO_RENDEZVOUS_PORT, "HOROVOD_GLOO_RENDEZVOUS_PORT")   \
  X(kHorovodElastic, HOROVOD_ELASTIC, "HOROVOD_ELASTIC")                                        \
  X(kHorovodGlooIface, HOROVOD_GLOO_IFACE, "HOROVOD_GLOO_IFACE")                                \
  X(kHorovodGlooTimeoutSeconds, HOROVOD_GLOO_TIMEOUT_SECONDS, "HOROVOD_GLOO_TIMEOUT_SECONDS")   \
  /* EFDL's: the job and the round (worker_env.cc) */                                           \
  X(kJobId, JOB_ID, "EFDL_JOB_ID")                                                              \
  X(kNodeId, NODE_ID, "EFDL_NODE_ID")                                                           \
  X(kRound, ROUND, "EFDL_ROUND")                                                                \
  X(kRestartCount, RESTART_COUNT, "EFDL_RESTART_COUNT")                                         \
  X(kNumMinWorkers, NUM_MIN_WORKERS, "EFDL_NUM_MIN_WORKERS")                                    \
  X(kNumMaxWorkers, NUM_MAX_WORKERS, "EFDL_NUM_MAX_WORKERS")                                    \
  X(kControlSocket, CONTROL_SOCKET, "EFDL_CONTROL_SOCKET")                                      \
  X(kJobSecret, JOB_SECRET, "EFDL_JOB_SECRET")                                                  \
  X(kLauncher, LAUNCHER, "EFDL_LAUNCHER")                                                       \
  X(kSharedEtcd, SHARED_ETCD, "EFDL_SHARED_ETCD")                                               \
  X(kEtcdEndpoints, ETCD_ENDPOINTS, "EFDL_ETCD_ENDPOINTS")                                      \
  X(kHorovod, HOROVOD, "EFDL_HOROVOD")                                                          \
  X(kBin, BIN, "EFDL_BIN")                                                                      \
  X(kReexecuted, REEXECUTED, "EFDL_REEXECUTED")                                                 \
  X(kLogLevel, LOG_LEVEL, "EFDL_LOG_LEVEL")                                                     \
  /* snapshots: where, who persists, how (docs/snapshots.md) */                                 \
  X(kSnapshotDir, SNAPSHOT_DIR, "EFDL_SNAPSHOT_DIR")                                            \
  X(kShmDir, SHM_DIR, "EFDL_SHM_DIR")                                                           \
  X(kArenaHolder, ARENA_HOLDER, "EFDL_ARENA_HOLDER")                                            \
  X(kAgentPersists, AGENT_PERSISTS, "EFDL_AGENT_PERSISTS")                                      \
  X(kSnapshotKeep, SNAPSHOT_KEEP, "EFDL_SNAPSHOT_KEEP")                                         \
  X(kSnapshotPerRank, SNAPSHOT_PER_RANK, "EFDL_SNAPSHOT_PER_RANK")                              \
  X(kSnapshotHmac, SNAPSHOT_HMAC, "EFDL_SNAPSHOT_HMAC")                                         \
  X(kPersistMinIntervalMs, PERSIST_MIN_INTERVAL_MS, "EFDL_PERSIST_MIN_INTERVAL_MS")             \
  X(kPeerCopy, PEER_COPY, "EFDL_PEER_COPY")                                                     \
  X(kSnapshotSlots, SNAPSHOT_SLOTS, "EFDL_SNAPSHOT_SLOTS")                                      \
  X(kSnapshotThreads, SNAPSHOT_THREADS, "EFDL_SNAPSHOT_THREADS")                                \
  X(kCommitChecksum, COMMIT_CHECKSUM, "EFDL_COMMIT_CHECKSUM")                                   \
  X(kFastCommit, FAST_COMMIT, "EFDL_FAST_COMMIT")                                               \
  X(kUnpickleAllow, UNPICKLE_ALLOW, "EFDL_UNPICKLE_ALLOW")                                      \
  X(kRestoreOtherProgram, RESTORE_OTHER_PROGRAM, "EFDL_RESTORE_OTHER_PROGRAM")                  \
  /* pre-started workers (src/agent/zygote.h; python/efdl/preload.py) */                        \
  X(kPreloadPath, PRELOAD_PATH, "EFDL_PRELOAD_PATH")                                            \
  X(kImportsDir, IMPORTS_DIR, "EFDL_IMPORTS_DIR")                                               \
  X(kPreloadModules, PRELOAD_MODULES, "EFDL_PRELOAD_MODULES")                                   \
  /* hangs (src/health/progress_board.h; python/efdl/_progress.py) */                           \
  X(kProgressBoard, PROGRESS_BOARD, "EFDL_PROGRESS_BOARD")                                      \
  X(kProgressSlot, PROGRESS_SLOT, "EFDL_PROGRESS_SLOT")                                         \
  X(kStackDir, STACK_DIR, "EFDL_STACK_DIR")                                                     \
  X(kStackSignal, STACK_SIGNAL, "EFDL_STACK_SIGNAL")                                            \
  /* stragglers: efdl run's flags (src/health/straggler_rules.h; src/cli/run_command.cc) */     \
  X(kStragglerFactor, STRAGGLER_FACTOR, "EFDL_STRAGGLER_FACTOR")                                \
  X(kStragglerWindow, STRAGGLER_WINDOW, "EFDL_STRAGGLER_WINDOW")                                \
  X(kEvictStragglers, EVICT_STRAGGLERS, "EFDL_EVICT_STRAGGLERS")

namespace efdl::envvar {

#define EFDL_ENV_NAME_CONSTANT(constant, python_name, value) \
  inline constexpr const char* constant = value;
EFDL_ENV_NAMES(EFDL_ENV_NAME_CONSTANT)
#undef EFDL_ENV_NAME_CONSTANT

}  // namespace efdl::envvar
