// The node agent's elastic loop: follows the rendezvous' events and runs this node's workers.
//
// The Agent never touches etcd; it drives a rdzv::Rendezvous (real, or a scripted test double)
// and its collaborators, one job each (docs/ARCHITECTURE.md, src/agent/): RoundWorkers (the
// control socket and the round's workers), NodeSnapshots, WarmPool, HangWatch, StragglerWatch,
// NodeFailures and NodeObserver. Run() is single-threaded and must be called from a thread that
// outlives the workers (their PR_SET_PDEATHSIG follows the spawning thread): normally the
// process' main thread.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent/hang_watch.h"
#include "agent/node_failures.h"
#include "agent/node_observer.h"
#include "agent/node_snapshots.h"
#include "agent/peer_copy.h"
#include "agent/round_workers.h"
#include "agent/straggler_watch.h"
#include "agent/warm_pool.h"
#include "agent/worker_group.h"
#include "common/group_reaper.h"
#include "common/job_spec.h"
#include "health/exclusion_rules.h"
#include "health/hang_monitor.h"
#include "health/straggler_rules.h"
#include "metrics/agent_metrics.h"
#include "rendezvous/rendezvous.h"

namespace efdl::agent {

// The job's identity (job and node id, nproc, min/max nodes, world size: >0 a fragmented job,
// here only for messages; advertise_addr: this node's numeric address, MASTER_ADDR when it is
// rank 0, for messages) plus how this agent runs its workers: one field per `efdl run` setting
// that shapes them, flat on purpose (a plain value PlanRun builds once and the agent only reads).
struct AgentOptions : JobSpec {
  std::vector<std::string> command;        // the worker program and its arguments
  // Worker failures of this node's own (not collateral) after which it gives up for good, where
  // exclusion does not apply (exclude_after 0, or the job cannot go on without this node).
  int max_restarts = 3;
  // Nodes that keep failing (issue #32, src/health/exclusion_rules.h): the exclude_after-th own
  // failure within exclude_window excludes the node from the job's rounds for exclude_cooldown
  // (doubling with each exclusion); 0: never excluded.
  int exclude_after = 3;
  std::chrono::milliseconds exclude_window{std::chrono::seconds(600)};
  std::chrono::milliseconds exclude_cooldown{std::chrono::seconds(300)};
  std::chrono::milliseconds stop_grace{std::chrono::seconds(10)};
  std::string log_dir;                     // empty: worker output only to our stdout/stderr
  std::string snapshot_dir;                // passed to workers as EFDL_SNAPSHOT_DIR
  bool shared_etcd = false;                // run with --etcd: workers get EFDL_SHARED_ETCD=1
  std::string job_secret;                  // passed to workers as EFDL_JOB_SECRET; never logged
  std::string control_socket_path;         // empty: control.sock in a private temp directory
  // The interface that holds advertise_addr (PlanRun: ChooseNetwork). Workers and --launcher processes get
  // it as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless the agent's own environment sets
  // those, and as HOROVOD_GLOO_IFACE; empty: none of them is set.
  std::string gloo_iface;
  // `efdl run --resume-args`: appended to `command` on every start of workers that resumes the
  // job (a round after the job's first: docs/integrations.md, "Programs with their own
  // checkpoint").
  std::vector<std::string> resume_args;
  // `efdl run --horovod`: the directory whose `horovod` package is EFDL's stand-in
  // (python/efdl/_horovod_shim), put in front of the PYTHONPATH of workers and launchers; empty:
  // none.
  std::string horovod_shim_dir;
  // One process per node (a third-party launcher such as torchrun) with LauncherEnvironment()
  // instead of `nproc` workers with WorkerEnvironment().
  bool launcher = false;
  // Python commands: keep a pre-started worker per local rank (SparePool) to activate at the
  // next round instead of spawning one.
  bool prestart = false;
  // The user asked for it (--prestart): a pool that cannot work is worth a warning; otherwise
  // (the default) falling back to spawned workers is only logged as information.
  bool prestart_requested = false;
  // Spares are forked from a zygote (zygote.h); false: each is an interpreter of its own.
  bool zygote = true;
  // The zygote also imports what the program's workers imported (zygote.h, "Learning the
  // program's imports"); --no-learn-imports: only EFDL_PRELOAD_MODULES.
  bool learn_imports = true;
  // `efdl run --hang-timeout` (issue #32, src/health/hang_rules.h): < 0 auto (the default), 0
  // off, > 0 the running timeout in seconds.
  double hang_timeout_s = -1;
  // Stragglers (issue #32 part 3, src/health/straggler_rules.h): --straggler-factor (0: off),
  // --straggler-window, --evict-stragglers. Needs the progress board (HangDetectionOn).
  health::StragglerPolicy stragglers;
  std::chrono::milliseconds poll_interval{std::chrono::milliseconds(50)};
  int out_fd = STDOUT_FILENO;              // where prefixed worker output goes
  int err_fd = STDERR_FILENO;
  // Polled every loop turn: a signal number (SIGTERM, SIGINT) means shut down; 0 means go on.
  std::function<int()> poll_signal;
  // Asked once before any worker is pre-started (run_command.cc reads the job's round record):
  // FailedPrecondition (the job is suspended; the message says what to do) ends the agent with
  // exit 1 at once, instead of after its spares imported the program; AlreadyExists (the job is
  // complete) starts no spare, the join then says so. Empty: no check.
  std::function<Status()> check_before_start;
  // The node's Prometheus metrics (src/metrics, `efdl run --metrics-port`), owned by the caller
  // and outliving the agent; null: none.
  metrics::AgentMetrics* metrics = nullptr;
};

// Hang detection runs (issue #32): not turned off, not --launcher, and the agent has a directory
// of its own (no control_socket_path given) for the board and the stacks.
inline bool HangDetectionOn(const AgentOptions& options) {
  return options.hang_timeout_s != 0 && !options.launcher && options.control_socket_path.empty();
}

// The environment one worker gets for `assignment` (the torchrun-compatible set plus EFDL_*
// and Horovod's HOROVOD_*).
std::map<std::string, std::string> WorkerEnvironment(const AgentOptions& options,
                                                     const rdzv::Assignment& assignment,
                                                     int local_rank, int restart_count,
                                                     const std::string& control_socket,
                                                     const std::string& arena_holder = {});

// The environment of the one process per node of `efdl run --launcher`: node-level values for
// an inner launcher (NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR/PORT, WORLD_SIZE = all
// processes, RANK = this node's first global rank, EFDL_NUM_MAX_WORKERS) plus the EFDL_* ids.
// No EFDL_CONTROL_SOCKET: the launcher's children are stopped by signals to its process group,
// and would each claim a local rank the agent does not know.
std::map<std::string, std::string> LauncherEnvironment(const AgentOptions& options,
                                                       const rdzv::Assignment& assignment,
                                                       int restart_count,
                                                       const std::string& arena_holder = {});

class Agent {
 public:
  Agent(AgentOptions options, rdzv::Rendezvous& rendezvous);
  ~Agent();
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  // Joins the job and runs this node until the job completes (returns 0), fails or runs out
  // of restarts (1), or a shutdown is requested (128 + the signal number).
  int Run();
  // Thread-safe: makes Run() stop its workers, leave the job and return.
  void RequestShutdown(int signal) { shutdown_signal_.store(signal); }

  // This node's own worker failures counted so far (RESTARTS in `efdl status`).
  int restarts() const { return failures_.restarts(); }
  // Times this node was excluded for a cool-down so far.
  int exclusions() const { return failures_.exclusions(); }
  // The control socket's path while Run() is running (empty before).
  const std::string& control_socket() const { return workers_.socket_path(); }

 private:
  // Why a failure of this node's workers is collateral ("" when it is its own): a hang whose
  // cause another node ended, or a worker whose stderr says its collective lost a peer.
  std::string CollateralCause(bool stalled, const std::vector<std::string>& stderr_tail) const;

  // Records a failure of this node's workers in `round` of `nnodes` nodes as the pending one
  // (NodeFailures::pending): `detail` says what failed; `collateral` why it is not this node's
  // own ("" when it is).
  void RecordFailure(int64_t round, int nnodes, std::string detail, std::string collateral = {});
  // Each returns an exit code when the agent must end.
  std::optional<int> HandleEvent(const rdzv::Event& event);
  std::optional<int> PollWorkers();
  // In-process: once every worker of the round said "returned", tells the rendezvous (their
  // exits, reaped later, are what complete a job).
  void NoteReturnedWorkers();
  // `early` (a rank of this node) returned while the node's other ranks trained: their
  // collectives lost it. Records it as this node's failure of `round` and reports it.
  void BlameEarlyExit0(int64_t round, const WorkerExit& early);
  // `why`: the round's reason (its ledger part says it).
  std::optional<int> StartRound(const rdzv::Assignment& assignment, const std::string& why);
  // A failure of the round that closed (failures_.pending()), counted as this node's own unless it
  // was collateral or came with a node leaving; the exclusion rule (exclusion_rules.h) then
  // restarts the workers, excludes the node (Exclude) or gives up: an exit code then.
  std::optional<int> CountPendingFailure(const rdzv::Assignment& next);
  // Records the exclusion in etcd, stops what runs of this round on this node and withdraws from
  // the job for the cool-down (Rendezvous::Withdraw); the node registers again after it.
  void Exclude(const PendingFailure& failure, const health::FailureVerdict& verdict);
  // Reports this node's own failure just recorded in failures_.pending() to the rendezvous, unless
  // it is the one that excludes this node: then it is counted and the node excluded at once,
  // before a next round can form with it (whose in-process peers would wait for its ranks in
  // that round's process-group creation until the pause and stop timeouts: seconds).
  void ReportOwnFailure(int64_t round, const std::string& detail);

  // In-process round changes (agent_in_process.cc; docs/control-protocol.md): workers under
  // efdl.elastic.run are paused at a round's close (RoundWorkers::Pause) and given the next
  // round's place instead of being stopped and started again.
  // At the next round: gives the paused workers their place in `a`; false when they cannot
  // continue (this node's worker count changed, a worker is gone): then they are stopped.
  bool ContinueInProcess(const rdzv::Assignment& a, int restart_count);
  // A worker's report that a collective of the current round failed: the round is redone.
  void ServeInProcessFailures();
  int RunUntilDone();   // Run() less the wait for retiring workers
  // Hang detection (agent_health.cc, issue #32; docs/operations.md "Hangs").
  void StartHangMonitor();
  // The round's workers started (`fresh`) or continue in-process: their progress is watched.
  void ArmHangMonitor(bool fresh);
  // A rank of this node made no progress for its timeout: writes every local worker's stack;
  // ends this node's workers when one of them caused it (a failure of this node), else waits
  // for the culprit's node, and ends them too if the hang outlasts another timeout.
  void CheckHang();
  // This node's rank caused the hang: SIGKILL of its workers, a failure of this node.
  void EndHungWorkers(int64_t round, const std::string& detail);
  // Stragglers (agent_straggler.cc, issue #32 part 3; docs/operations.md "Stragglers"): about
  // every second hands the round's progress reports to stragglers_ (cheap when nothing is due);
  // when it says this node is evicted, EvictAsStraggler records the exclusion (cause
  // "straggler"), withdraws from the job for the cool-down and stops the workers.
  void CheckStragglers();
  void EvictAsStraggler(const StragglerWatch::Eviction& eviction);
  // Leaves the job on `signal`: returns 128 + signal (and only it returns more than 128).
  int Shutdown(int signal);
  // What observer_ sees of this node's workers now (agent_observe.cc).
  NodeObserver::Sight Sight() const;
  // A round change's pause begins here (NodeObserver::BeginPause).
  void BeginPause(std::chrono::steady_clock::time_point at);
  // --log-dir's file of `rank`'s output in `round` (<dir>/<node>/round-R.rank-N.log); empty
  // without --log-dir.
  std::string WorkerLogPath(int64_t round, int rank) const;
  // kSuspended: stop workers gracefully, find the newest persisted step, report it, leave.
  int Suspend(const rdzv::Event& event);
  // Starts warm_'s spares with this agent's worker environment.
  void StartSparePool();
  // Starts the peer copy (peer_copy.h) when this job keeps one and offers its port in the acks;
  // a failure to start is one line, and the job goes on without it.
  void StartPeerCopy();
  // The shutdown signal received (or, in tests, options_.poll_signal's); 0: none.
  int PendingSignal() const;
  // RoundWorkers::Stop, with the hang monitor disarmed.
  void StopWorkers(bool graceful, const std::string& reason, bool release_after_snapshot = false,
                   const std::vector<int>& terminate_now = {});
  // The first time a failure counted against --max-restarts came with a worker that could not
  // connect to a peer: says which address was tried, what this node gave its workers and what
  // to set (once per agent). Failures that came with a node leaving are not explained: a peer
  // that died is refused too, and that needs no setting.
  void ExplainPeerConnectError(int64_t round, const std::optional<PeerConnectError>& error);

  // 13 members: the options, the rendezvous, the shutdown signal, the newest round, and the
  // collaborators (snapshots, the peer copy, the reaper, the round's workers, the warm pool,
  // hangs, failures, stragglers, the observer).
  const AgentOptions options_;
  rdzv::Rendezvous& rdzv_;
  std::atomic<int> shutdown_signal_{0};
  // The holder lock of the job's arenas, the persister, flushes, arena removal
  // (node_snapshots.h): its flusher answers through workers_' control socket; closed first.
  NodeSnapshots snapshots_;
  // The copy of this node's per-rank arenas on its ring successor, and its predecessor's here
  // (peer_copy.h; null: not kept). Stopped before the job's arenas are removed.
  std::unique_ptr<PeerCopy> peer_copy_;
  // Kills the workers' and spares' process groups (what they started included) should this
  // agent die without stopping them; declared before them so it outlives them.
  std::unique_ptr<GroupReaper> reaper_;
  // The control socket, the round's workers, retiring ones, the Horovod server, pause and
  // continue (round_workers.h).
  RoundWorkers workers_;
  // The spares (with options_.prestart for a python command) and the agent store (warm_pool.h).
  WarmPool warm_;
  // Hang detection: the progress board and the state of a hang (hang_watch.h; without a
  // monitor: --hang-timeout 0, --launcher, or no board).
  HangWatch hangs_;
  // What reached this node of the job's rounds.
  struct Rounds {
    rdzv::Assignment newest;   // the newest round started
    // When this node's workers of the newest round started (or continued in-process).
    std::chrono::steady_clock::time_point started{};
    int started_count = 0;     // rounds this node's workers started in (their restart count)
    bool any = false;          // any round (standby included) reached this node
  };
  Rounds rounds_;
  // This node's own failures, the streak of collateral ones, the end of an exclusion, the
  // failure of the round that closes (node_failures.h).
  NodeFailures failures_;
  // Straggler detection (straggler_watch.h): samples, summaries, the judge, eviction.
  StragglerWatch stragglers_;
  // The node's metrics and its part of the goodput ledger (node_observer.h).
  NodeObserver observer_;
};

}  // namespace efdl::agent
