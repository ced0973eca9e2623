#include "agent/agent.h"

#include <signal.h>
#include <sys/prctl.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/env_names.h"
#include "common/log.h"
#include "snapshot/arena_dir.h"
#include "snapshot/persist_settings.h"

namespace efdl::agent {

namespace {

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

}  // namespace

namespace {
health::ExclusionPolicy ExclusionPolicyOf(const AgentOptions& o) {
  health::ExclusionPolicy p;
  p.after = o.exclude_after;
  p.window = o.exclude_window;
  p.cooldown = o.exclude_cooldown;
  p.max_restarts = o.max_restarts;
  return p;
}

// Wall-clock time `after` from now, ISO-8601 UTC to the second (as the give-up records).
std::string WallTimeIn(std::chrono::milliseconds after) {
  const std::time_t secs = std::chrono::system_clock::to_time_t(
      std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::seconds>(after));
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
}

// "300", "0.4": seconds as the flags take them.
std::string Seconds(std::chrono::milliseconds d) {
  return fmt::format("{:g}", std::chrono::duration<double>(d).count());
}
}  // namespace

Agent::Agent(AgentOptions options, rdzv::Rendezvous& rendezvous)
    : options_(std::move(options)), rdzv_(rendezvous),
      snapshots_({options_.job_id, options_.node_id, options_.snapshot_dir, options_.job_secret,
                  /*persist=*/!options_.launcher, options_.metrics},
                 rendezvous),
      workers_({options_.job_id, options_.node_id, options_.control_socket_path,
                options_.stop_grace, options_.launcher, options_.job_secret}),
      warm_(rendezvous),
      hangs_({options_.job_id, options_.node_id, options_.nproc, options_.hang_timeout_s,
              [this](std::chrono::steady_clock::time_point seen, double silent_s, bool own) {
                observer_.HangDeclared(seen, silent_s, own, Sight());
              }}),
      failures_(ExclusionPolicyOf(options_), options_.min_nodes),
      stragglers_({options_.stragglers, options_.job_id, options_.node_id, options_.min_nodes,
                   options_.exclude_cooldown, options_.metrics},
                  rendezvous),
      observer_({options_.node_id, options_.min_nodes, options_.metrics}, rendezvous) {}

Agent::~Agent() {
  // Workers first: their stop may still talk to the control socket.
  workers_.StopAll();
  warm_.Stop();
  snapshots_.Close();  // its flusher answers through the control socket
  workers_.Close();
  // ~NodeSnapshots releases the holder lock.
}

int Agent::Run() {
  const int code = RunUntilDone();
  workers_.Retire(/*wait=*/true);   // workers of an earlier round still exiting
  if (code > 128) {
    // Only Shutdown returns 128 + a signal: the last line of a node that left on a signal says
    // that it left, and the exit code.
    EFDL_LOG_INFO("node {} left job '{}' on {}; its workers are stopped; exit code {}",
                  options_.node_id, options_.job_id, SignalName(code - 128), code);
  }
  return code;
}

int Agent::RunUntilDone() {
  if (auto reaper = GroupReaper::Start(); reaper.ok()) {
    reaper_ = std::move(reaper).value();
  } else {
    EFDL_LOG_WARN("{}: processes the workers start would outlive a SIGKILL of this agent",
                  reaper.status().message());
  }
  // The spares forked from the zygote become this agent's children by adoption (zygote.h); so
  // do processes a worker left behind, which the loop reaps (ReapAdoptedOrphans).
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    EFDL_LOG_WARN("cannot become a child subreaper ({}): pre-started workers are started, not "
                  "forked from a zygote", std::strerror(errno));
  }
  if (Status st = workers_.OpenControl(); !st.ok()) {
    EFDL_LOG_ERROR("{}", st.message());
    return 1;
  }
  StartHangMonitor();
  if (Status st = snapshots_.Open(); !st.ok()) {
    EFDL_LOG_ERROR("{}", st.message());
    return 1;
  }
  StartPeerCopy();
  bool prestart = options_.prestart && !options_.launcher;
  if (options_.check_before_start) {
    const Status st = options_.check_before_start();
    if (st.IsFailedPrecondition()) {
      EFDL_LOG_ERROR("{}", st.message());  // the job is suspended: the line says what to do
      return 1;
    }
    if (st.code() == Status::Code::kAlreadyExists) prestart = false;  // complete
  }
  if (prestart) StartSparePool();
  // Joining starts a new round at once, so the running nodes would stop training and wait for
  // our spares' imports: warm them up first, while the job goes on without us.
  if (const int sig = warm_.WarmUp([this] { return PendingSignal(); }); sig != 0) {
    return Shutdown(sig);
  }

  // `efdl status` shows this agent's count of its own failures from the first ack on (a node
  // hit only by collateral failures shows 0).
  rdzv_.ReportRestarts(failures_.restarts());
  if (Status st = rdzv_.Join(); !st.ok()) {
    if (st.IsFailedPrecondition()) {
      EFDL_LOG_ERROR("{}", st.message());  // e.g. the job is suspended: the line says what to do
    } else {
      EFDL_LOG_ERROR("cannot join job '{}': {}", options_.job_id, st.message());
    }
    return 1;
  }
  observer_.Joined();
  EFDL_LOG_INFO("node {} joined job '{}' with {} worker(s) per node, nodes {}:{}",
                options_.node_id, options_.job_id, options_.nproc, options_.min_nodes,
                options_.max_nodes);

  while (true) {
    if (const int sig = PendingSignal(); sig != 0) return Shutdown(sig);
    if (auto code = PollWorkers()) return *code;
    CheckHang();
    observer_.Update(Sight());
    CheckStragglers();
    snapshots_.ServeFlushes(workers_.control());
    ServeInProcessFailures();
    NoteReturnedWorkers();
    warm_.Maintain();
    workers_.Maintain();
    if (auto event = rdzv_.WaitEvent(options_.poll_interval)) {
      if (auto code = HandleEvent(*event)) return *code;
    }
  }
}

namespace {
// This node's ranks of round `a`, as a log line names them: "rank 3", "ranks 2..3".
std::string LocalRanks(const rdzv::Assignment& a) {
  const int first = a.rank_offset, last = first + a.nproc - 1;
  return first == last ? fmt::format("rank {}", first) : fmt::format("ranks {}..{}", first, last);
}
}  // namespace

void Agent::NoteReturnedWorkers() {
  const std::optional<int64_t> round = workers_.AllReturned();
  if (!round) return;
  // Every worker's program returned (in-process, they said so before tearing down): if the
  // peers still train, the round is about to break and this node is its cause; the next ack
  // says so before the exits are reaped, which can take longer than the coordinator waits.
  workers_.SetExited0({*round, LocalRanks(rounds_.newest)});
  rdzv_.NoteWorkersReturned(*round, workers_.exited0()->second);
}

std::optional<int> Agent::PollWorkers() {
  WorkerGroup* group = workers_.group();
  if (!group) return std::nullopt;
  switch (group->Poll()) {
    case WorkerGroup::State::kRunning:
      return std::nullopt;
    case WorkerGroup::State::kSucceeded: {
      EFDL_LOG_INFO("round {}: all {} worker(s) of this node exited 0", group->round(),
                    rounds_.newest.nproc);
      snapshots_.PersistNewest("reporting the workers' success");
      workers_.SetExited0({group->round(), LocalRanks(rounds_.newest)});
      rdzv_.ReportWorkersExited0(group->round(), workers_.exited0()->second);
      workers_.Succeeded();
      return std::nullopt;
    }
    case WorkerGroup::State::kFailed:
      break;
  }
  const int64_t round = group->round();
  // Stalled for most of the hang timeout: another node ended the hang's cause, which broke
  // these workers' collectives (a failure of that node, not of this one).
  const bool stalled = hangs_.Stalled();
  WorkerExit failure = *group->first_failure();
  std::optional<WorkerExit> early = workers_.EarlyExit0(rounds_.newest.rank_offset);
  if (!early) {
    // The failure may be a lost peer and the peer a rank of this node that returned: reaped in
    // the same poll as the failure, or still tearing down (its exit is often reaped after the
    // failure it caused; the failing rank's traceback may not even be read yet, so its output
    // cannot tell). Give a rank still running a moment to exit by itself before the stop's
    // signals; a rank that lost the same peer fails too and ends the wait at once.
    early = workers_.AwaitOwnExit0();
  }
  BeginPause(std::chrono::steady_clock::now());
  std::string detail =
      fmt::format("rank {} {}", failure.rank, DescribeWaitStatus(failure.wait_status));
  EFDL_LOG_WARN("round {}: {}; stopping this node's other workers", round, detail);
  // The round is broken for every node: peers wait in collectives that cannot complete.
  StopWorkers(/*graceful=*/false, fmt::format("{} on node {}", detail, options_.node_id));
  if (early) {
    // A rank of this node returned first: the failures after it are its peers' collectives
    // losing it, this node's failure whatever their output says.
    failures_.pending().reset();
    BlameEarlyExit0(round, *early);
    return std::nullopt;
  }
  const RoundWorkers::LastStop& stopped = workers_.last_stop();
  failures_.pending() = PendingFailure{round,
                                    rounds_.newest.nnodes,
                                    detail,
                                    stopped.connect_error,
                                    stopped.failure_tail,
                                    CollateralCause(stalled, stopped.failure_tail)};
  if (!failures_.pending()->collateral.empty()) {
    EFDL_LOG_WARN("round {}: {} because {}: not this node's failure", round, detail,
                  failures_.pending()->collateral);
    rdzv_.ReportLostPeer(round, detail, failures_.pending()->collateral);
  } else {
    ReportOwnFailure(round, detail);
  }
  return std::nullopt;
}

std::optional<int> Agent::HandleEvent(const rdzv::Event& event) {
  using Type = rdzv::Event::Type;
  switch (event.type) {
    case Type::kRoundStarted:
      rounds_.any = true;
      return StartRound(event.assignment, event.message);
    case Type::kRoundClosing:
      EFDL_LOG_INFO("round {} closing ({}){}{}", event.round,
                    event.graceful ? "graceful" : "not graceful",
                    event.message.empty() ? "" : ": ", event.message);
      observer_.RoundClosing(event.graceful, Sight());
      // A worker that already failed on its own is this node's failure too, even when a peer's
      // failure closed the round first: reap it before stopping the rest, or a program that
      // fails on every node is counted only on the node whose failure happened to be seen first.
      if (auto code = PollWorkers()) return *code;
      if (!event.graceful && workers_.active()) {
        // A rank of this node returned while the others trained (in-process it said so before
        // the failure it caused reached this loop): this node's failure, reported before the
        // coordinator forms the next round without a cause.
        if (const auto early = workers_.EarlyExit0(rounds_.newest.rank_offset);
            early && (!failures_.pending() || !failures_.pending()->collateral.empty())) {
          BlameEarlyExit0(workers_.group()->round(), *early);
        }
      }
      if (workers_.active() && workers_.group()->round() <= event.round) {
        const std::string reason = event.message.empty()
                                       ? fmt::format("round {} is closing", event.round)
                                       : event.message;
        std::vector<int> unpaused;
        if (workers_.Pause(event.graceful, reason, unpaused,
                           [this] { return PendingSignal() != 0; })) {
          if (event.graceful) snapshots_.PersistNewest("a graceful round change");
          return std::nullopt;
        }
        // A worker that failed on its own while pausing is this node's failure, as above.
        if (auto code = PollWorkers()) return *code;
        if (!workers_.group()) return std::nullopt;
        if (!event.graceful && workers_.WaitForOwnExits()) {
          // A worker ended by itself after all (its own exception, or a return while its peers
          // trained): this node's failure or exit 0, reported as such (issue #32, blame).
          if (auto code = PollWorkers()) return *code;
          if (!workers_.group()) return std::nullopt;
          // One of several returned while the others live on (paused in-process after their
          // collective lost it, a lost peer so far).
          if (const auto early = workers_.EarlyExit0(rounds_.newest.rank_offset);
              early && (!failures_.pending() || !failures_.pending()->collateral.empty())) {
            BlameEarlyExit0(workers_.group()->round(), *early);
          }
        }
        // Graceful: the next round's workers may start while these exit (after their final
        // snapshot, and when they hold no GPU memory). Not with --launcher: its one process
        // stands for workers of several local ranks, some of which may still be writing.
        StopWorkers(event.graceful, reason,
                    /*release_after_snapshot=*/event.graceful && !options_.launcher, unpaused);
        // The workers' final commit is in shared memory now: store it before the next round.
        if (event.graceful) snapshots_.PersistNewest("a graceful round change");
      }
      return std::nullopt;
    case Type::kJobComplete:
      observer_.EndLedger("complete");
      warm_.Stop();
      StopWorkers(/*graceful=*/false, "the job is complete");
      snapshots_.PersistNewest("the job's end");
      snapshots_.Close();
      peer_copy_.reset();   // no copy arrives once the arenas are gone
      snapshots_.RemoveJobArenas();
      if (!rounds_.any) {
        // A late agent: the job id ran to completion before; it still exits 0, but says so.
        EFDL_LOG_WARN("job '{}' was already complete ({}); nothing ran on this node. To run it "
                      "again from the beginning: `efdl reset --job {} --etcd ...` once no agent "
                      "of it runs, or start it under a new --job",
                      options_.job_id, event.message, options_.job_id);
      } else if (rounds_.started_count == 0) {
        EFDL_LOG_WARN("job '{}' is complete; this node was a standby throughout (the job was at "
                      "its --nnodes MAX or --world-size): its program never ran here",
                      options_.job_id);
      } else {
        EFDL_LOG_INFO("job '{}' is complete", options_.job_id);
      }
      return 0;
    case Type::kFenced:
      observer_.Fenced(Sight());
      EFDL_LOG_WARN("node {} lost its lease: fenced out of round {}; stopping workers{}{}",
                    options_.node_id, event.round, event.message.empty() ? "" : ": ",
                    event.message);
      StopWorkers(/*graceful=*/false, fmt::format("node fenced out of round {}", event.round));
      snapshots_.StopWriting();  // no longer a member: storage is not ours to write
      if (peer_copy_) peer_copy_->StopSending();
      warm_.Clear();  // refilled when the node takes part in a round again
      return std::nullopt;
    case Type::kSuspended:
      return Suspend(event);
    case Type::kPeerGaveUp:
      EFDL_LOG_WARN("{}", event.message);
      return std::nullopt;
    case Type::kFailed:
      warm_.Stop();
      StopWorkers(/*graceful=*/false, event.message);
      snapshots_.PersistNewest("leaving the failed job");
      EFDL_LOG_ERROR("job '{}' failed: {}", options_.job_id, event.message);
      observer_.EndLedger("failed");
      rdzv_.Leave();
      return 1;
  }
  return std::nullopt;
}

std::optional<int> Agent::StartRound(const rdzv::Assignment& a, const std::string& why) {
  if (workers_.active()) {
    StopWorkers(/*graceful=*/false, fmt::format("round {} started", a.round));
  }
  // A change of the job's node count ends a streak of collateral failures (issue #32).
  if (!a.standby) failures_.RoundFormed(a.nnodes);
  if (const auto& exited0 = workers_.exited0(); a.early_exit && exited0 && !failures_.pending()) {
    // This node's workers all exited 0 while their peers still trained: the peers'
    // collectives lost them, and the coordinator named this node the cause (NameCause).
    const std::string detail =
        fmt::format("{} exited 0 before the job completed", exited0->second);
    EFDL_LOG_WARN("round {}: {}: their peers' collectives lost them and the round was formed "
                  "again; this node's failure", exited0->first, detail);
    RecordFailure(exited0->first, a.nnodes, detail);
  }
  workers_.ForgetExited0();
  if (auto code = CountPendingFailure(a)) return code;
  // The round it withdrew from, or one announced before the withdrawal took effect: an
  // excluded node registers again only once the cool-down is over.
  switch (failures_.CheckOut(std::chrono::steady_clock::now())) {
    case NodeFailures::Out::kNo:
      break;
    case NodeFailures::Out::kStill:
      return std::nullopt;
    case NodeFailures::Out::kBack:
      EFDL_LOG_INFO("node {} is back in job '{}' after its cool-down, with fresh workers",
                  options_.node_id, options_.job_id);
      break;
  }
  rounds_.newest = a;
  observer_.RoundStarts(a);
  if (!a.standby) observer_.BeginLedgerPart(a, why, Sight());
  workers_.SetRound(a.round);
  snapshots_.SetRound(a.rank_offset, a.standby ? 0 : a.nproc);
  if (peer_copy_) {
    peer_copy_->SetRound(a.round, a.rank_offset, a.standby ? 0 : a.nproc, a.peer_copy);
  }
  if (a.standby) {
    if (workers_.group()) {
      // Paused in-process at the last round's close: they snapshotted and wait; they exit now.
      StopWorkers(/*graceful=*/true, fmt::format("round {}: this node is a standby", a.round));
    }
    if (options_.world_size > 0) {
      EFDL_LOG_INFO("round {}: standby (the members' processes already add up to world size "
                    "{}); waiting for a member to leave", a.round, options_.world_size);
    } else {
      EFDL_LOG_INFO("round {}: standby (the job is at its maximum of {} nodes); waiting for a "
                    "member to leave", a.round, options_.max_nodes);
    }
    return std::nullopt;
  }
  const int restart_count = rounds_.started_count++;
  if (workers_.paused() && ContinueInProcess(a, restart_count)) {
    rounds_.started = std::chrono::steady_clock::now();
    ArmHangMonitor(/*fresh=*/false);
    return std::nullopt;
  }
  WorkerGroupOptions wg;
  wg.argv = options_.command;
  // A round after the job's first resumes it (a crash, a join or leave, a suspend, agents
  // restarted against the same etcd): the program is told so by its own flag.
  if (a.round > 1 && !options_.resume_args.empty()) {
    wg.extra_args = options_.resume_args;
    EFDL_LOG_INFO("round {}: the job resumes: the command gets --resume-args {}", a.round,
                  fmt::join(options_.resume_args, " "));
  }
  wg.round = a.round;
  wg.out_fd = options_.out_fd;
  wg.err_fd = options_.err_fd;
  wg.spares = warm_.spares();
  wg.reaper = reaper_.get();
  // --launcher: one process (local rank 0) that starts the node's a.nproc workers itself.
  const int processes = options_.launcher ? 1 : a.nproc;
  for (int lr = 0; lr < processes; ++lr) {
    WorkerSpec spec;
    spec.local_rank = lr;
    spec.rank = a.rank_offset + lr;
    spec.env = options_.launcher
                   ? LauncherEnvironment(options_, a, restart_count, snapshots_.holder())
                   : WorkerEnvironment(options_, a, lr, restart_count, workers_.socket_path(),
                                       snapshots_.holder());
    spec.log_path = WorkerLogPath(a.round, spec.rank);
    wg.workers.push_back(std::move(spec));
  }
  EFDL_LOG_INFO("round {}: node rank {} of {}, ranks {}..{} of world {}, master {}:{}{}", a.round,
                a.node_rank, a.nnodes, a.rank_offset, a.rank_offset + a.nproc - 1, a.world_size,
                a.master_addr, a.master_port,
                options_.launcher ? " (one launcher process for them)" : "");
  workers_.StartHorovodRendezvous(a);
  auto group = WorkerGroup::Start(std::move(wg));
  if (!group.ok()) {
    EFDL_LOG_ERROR("cannot start workers: {}", group.status().message());
    rdzv_.Leave();
    return 1;
  }
  workers_.Started(std::move(group).value());
  rounds_.started = std::chrono::steady_clock::now();
  ArmHangMonitor(/*fresh=*/true);
  return std::nullopt;
}

std::optional<int> Agent::CountPendingFailure(const rdzv::Assignment& a) {
  if (!failures_.pending()) return std::nullopt;
  const PendingFailure f = *std::exchange(failures_.pending(), std::nullopt);
  if (options_.metrics) options_.metrics->CountWorkerFailure(/*own=*/f.collateral.empty());
  if (!f.collateral.empty()) {
    // A streak of collateral failures may be this node's doing after all (NodeFailures).
    // (rounds_.started is still the failed round's: the next one starts after this count.) A
    // change of the job's node count starts a new streak (StartRound).
    if (!failures_.CollateralCounts(std::chrono::steady_clock::now(), rounds_.started)) {
      EFDL_LOG_INFO("round {} failure ({}) came from {}: not counted as a restart", f.round,
                    f.detail, f.collateral);
      return std::nullopt;
    }
    EFDL_LOG_WARN("round {} failure ({}) came from {}, but it is the {}th such failure in a row "
                  "with no round lasting {} s between them: counted as this node's",
                  f.round, f.detail, f.collateral, failures_.streak(),
                  std::chrono::duration_cast<std::chrono::seconds>(NodeFailures::kStreakReset)
                      .count());
  } else {
    failures_.EndStreak();
  }
  if (!a.standby && a.nnodes < f.nnodes) {
    // A peer left with the failure: its loss broke our workers; not our failure.
    EFDL_LOG_INFO("round {} failure ({}) came with a node leaving: not counted as a restart",
                  f.round, f.detail);
    return std::nullopt;
  }
  ExplainPeerConnectError(f.round, f.connect_error);
  // The job can go on without this node when the round holds MIN other nodes (a standby's
  // round holds only others); then the node is excluded for a while instead of giving up.
  const bool can_exclude = failures_.CanExclude(a);
  const health::FailureVerdict verdict =
      failures_.Count(std::chrono::steady_clock::now(), can_exclude);
  const int restarts = failures_.restarts();
  if (verdict.action == health::FailureVerdict::Action::kExclude) {
    Exclude(f, verdict);
    return std::nullopt;
  }
  if (verdict.action == health::FailureVerdict::Action::kGiveUp) {
    const std::string reason =
        fmt::format("{} in round {}; worker failures on this node: {} (--max-restarts {})",
                    f.detail, f.round, restarts, options_.max_restarts);
    EFDL_LOG_ERROR("giving up: {}", reason);
    // The other nodes print it at once, `efdl status` shows it.
    if (Status st = rdzv_.RecordGiveUp(reason, f.stderr_tail); !st.ok()) {
      EFDL_LOG_WARN("{}", st.message());
    }
    rdzv_.Leave();
    return 1;
  }
  if (failures_.policy().enabled() && can_exclude) {
    EFDL_LOG_INFO("restart {} after {} in round {}: this node's own failure {} of {} within {} s "
                  "before it is excluded for a cool-down (--exclude-after, --exclude-window)",
                  restarts, f.detail, f.round, verdict.in_window, options_.exclude_after,
                  Seconds(options_.exclude_window));
  } else {
    EFDL_LOG_INFO("restart {} of {} after {} in round {}", restarts, options_.max_restarts,
                  f.detail, f.round);
  }
  rdzv_.ReportRestarts(restarts);   // efdl status shows the counted failures only
  return std::nullopt;
}

void Agent::Exclude(const PendingFailure& f, const health::FailureVerdict& v) {
  const std::string until = WallTimeIn(v.cooldown);
  rdzv::ExclusionRecord rec;
  rec.reason = fmt::format("{} in round {}; {} of this node's own worker failures within {} s "
                           "(--exclude-after {})",
                           f.detail, f.round, v.in_window, Seconds(options_.exclude_window),
                           options_.exclude_after);
  rec.time = WallTimeIn(std::chrono::milliseconds(0));
  rec.until = until;
  rec.failures = v.in_window;
  rec.exclusion = v.exclusion;
  rec.stderr_tail = f.stderr_tail;
  EFDL_LOG_WARN("node {} is excluded from job '{}' for {} s (exclusion {}): {}; the job goes on "
                "without it, and it rejoins with fresh workers at {}",
                options_.node_id, options_.job_id, Seconds(v.cooldown), v.exclusion, rec.reason,
                until);
  rdzv_.ReportRestarts(failures_.restarts());
  // `efdl status` shows it until the node registers again.
  if (Status st = rdzv_.RecordExclusion(rec); !st.ok()) EFDL_LOG_WARN("{}", st.message());
  // Workers paused in-process at the last round's close end now; so do the spares, which the
  // pool refills when the node takes part in a round again.
  StopWorkers(/*graceful=*/false, fmt::format("node {} is excluded", options_.node_id));
  snapshots_.StopWriting();   // no longer a member: storage is not ours to write
  if (peer_copy_) peer_copy_->StopSending();
  warm_.Clear();
  rdzv_.Withdraw(v.cooldown);
  failures_.OutUntil(v.until);
}

void Agent::StartSparePool() {
  SparePoolOptions so;
  so.command = options_.command;
  so.nproc = options_.nproc;
  so.requested = options_.prestart_requested;
  so.zygote = options_.zygote;
  // The agent's own directory (its control socket's), removed when it ends.
  if (options_.learn_imports) {
    so.imports_dir = std::filesystem::path(workers_.socket_path()).parent_path().string();
  }
  so.reaper = reaper_.get();
  // What a worker's environment will hold apart from the per-round variables (OMP_NUM_THREADS,
  // ...): the spares must start with it, as libraries read some of it while being imported.
  rdzv::Assignment typical;
  typical.nproc = options_.nproc;
  for (int lr = 0; lr < options_.nproc; ++lr) {
    so.start_env[lr] =
        WorkerEnvironment(options_, typical, lr, 0, workers_.socket_path(), snapshots_.holder());
  }
  warm_.Start(std::move(so));
}

int Agent::PendingSignal() const {
  const int sig = shutdown_signal_.load();
  return sig == 0 && options_.poll_signal ? options_.poll_signal() : sig;
}

void Agent::BlameEarlyExit0(int64_t round, const WorkerExit& early) {
  const std::string detail =
      fmt::format("rank {} exited 0 before the job completed", early.rank);
  EFDL_LOG_WARN("round {}: {} while this node's other ranks trained: the collectives lost it; "
                "this node's failure", round, detail);
  RecordFailure(round, rounds_.newest.nnodes, detail);
  ReportOwnFailure(round, detail);
}

void Agent::RecordFailure(int64_t round, int nnodes, std::string detail,
                          std::string collateral) {
  failures_.pending() =
      PendingFailure{round, nnodes, std::move(detail), std::nullopt, {}, std::move(collateral)};
}

void Agent::ReportOwnFailure(int64_t round, const std::string& detail) {
  // The rule CountPendingFailure applies at the next round, asked ahead: the round that failed
  // is the one the next would be judged against (the same nodes, no leave seen).
  const bool can_exclude = failures_.CanExclude(rounds_.newest);
  if (failures_.pending() && failures_.pending()->collateral.empty() && !failures_.out() &&
      failures_.CountAhead(std::chrono::steady_clock::now(), can_exclude).action ==
          health::FailureVerdict::Action::kExclude) {
    CountPendingFailure(rounds_.newest);   // counts it, and Exclude withdraws the node now
    return;
  }
  rdzv_.ReportWorkerFailure(round, detail);
}

void Agent::StopWorkers(bool graceful, const std::string& reason, bool release_after_snapshot,
                        const std::vector<int>& terminate_now) {
  hangs_.Disarm();
  workers_.Stop(graceful, reason, release_after_snapshot, terminate_now);
}

void Agent::ExplainPeerConnectError(int64_t round, const std::optional<PeerConnectError>& e) {
  if (!e || !failures_.FirstConnectErrorExplanation()) return;
  auto setting = [](const char* name, const std::string& ours) {
    const char* user = std::getenv(name);
    if (user != nullptr) return fmt::format("{}={} (set by you)", name, user);
    return ours.empty() ? fmt::format("no {}", name) : fmt::format("{}={}", name, ours);
  };
  EFDL_LOG_WARN(
      "round {}: rank {} could not connect to a peer at {}:{} ({}). The nodes must "
      "reach each other's workers at the address each advertises; this node advertises {} and "
      "gives its workers {} and {}. If {} is not an address the nodes reach each other at, "
      "start every node with --iface NAME (the interface of the nodes' network; or set "
      "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME) or --advertise-addr ADDR, and check that no "
      "firewall blocks the ports between the nodes (docs/troubleshooting.md)",
      round, e->rank, e->address, e->port, e->line, options_.advertise_addr,
      setting(envvar::kGlooSocketIfname, options_.gloo_iface),
      setting(envvar::kNcclSocketIfname, options_.gloo_iface), e->address);
}

int Agent::Suspend(const rdzv::Event& event) {
  EFDL_LOG_INFO("job '{}' is being suspended ({}): stopping workers after their snapshot",
                options_.job_id, event.message);
  // Graceful: each worker snapshots at its next commit() and persists before exiting; one that
  // does not answer gets SIGTERM, whose State hook persists the newest snapshot too.
  StopWorkers(/*graceful=*/true, fmt::format("job '{}' is being suspended", options_.job_id));
  observer_.EndLedger("suspended");
  // Their final commit — or the newest one when they were already gone (crashed, between
  // rounds) — goes to storage, which is read next.
  snapshots_.PersistNewest("the suspend report");
  const std::optional<int64_t> reported = workers_.channel().newest_persisted_step();
  const std::optional<int64_t> committed = workers_.control().newest_step();
  const std::optional<rdzv::PersistedPoint> stored = snapshots_.NewestStored();
  // Storage is the truth for a resume; the workers' reports only tell whether it is behind.
  std::optional<rdzv::PersistedPoint> point = stored;
  if (!point && reported) point = rdzv::PersistedPoint{0, *reported, std::nullopt};
  const std::optional<int64_t> step = point ? std::optional<int64_t>(point->step) : std::nullopt;
  if (reported && !stored) {
    EFDL_LOG_WARN("a worker reported step {} persisted, but {} holds no snapshot", *reported,
                  options_.snapshot_dir);
  } else if (reported && committed && *committed > *reported) {
    EFDL_LOG_WARN("the newest snapshot (step {}) is only in this node's memory; storage has "
                  "step {}", *committed, *reported);
  }
  if (Status st = rdzv_.ReportSuspended(point); !st.ok()) EFDL_LOG_WARN("{}", st.message());
  rdzv_.Leave();
  // A resume restores from storage (the step just reported); the arenas would only hold memory.
  snapshots_.Close();
  peer_copy_.reset();
  snapshots_.RemoveJobArenas();
  if (step) {
    EFDL_LOG_INFO("job '{}': suspended at step {}", options_.job_id, *step);
  } else {
    EFDL_LOG_INFO("job '{}': suspended; no snapshot of it is in {} (its workers never "
                  "committed, or this node does not write storage)",
                  options_.job_id, options_.snapshot_dir);
  }
  return 0;
}

std::string Agent::WorkerLogPath(int64_t round, int rank) const {
  if (options_.log_dir.empty()) return "";
  return (std::filesystem::path(options_.log_dir) / options_.node_id /
          fmt::format("round-{}.rank-{}.log", round, rank))
      .string();
}

int Agent::Shutdown(int signal) {
  observer_.EndLedger("signal");
  EFDL_LOG_INFO("received {}: leaving job '{}' and stopping workers", SignalName(signal),
                options_.job_id);
  // Leave first so the other nodes re-round at once, while our workers take their snapshot.
  rdzv_.Leave();
  warm_.Stop();
  StopWorkers(/*graceful=*/true, fmt::format("node {} is leaving ({})", options_.node_id,
                                             SignalName(signal)));
  snapshots_.PersistNewest("exiting");  // also when no workers ran (a crash between rounds)
  return 128 + signal;
}

void Agent::StartPeerCopy() {
  if (options_.launcher) return;   // the workers persist themselves: no agent-side snapshots
  auto getenv = [](const char* name) -> const char* { return std::getenv(name); };
  auto settings = snapshot::PersistSettingsFromEnvironment(getenv, options_.job_secret);
  if (!settings.ok()) return;   // NodeSnapshots::Open refused it already
  std::string why_not;
  if (!PeerCopyWanted(getenv, settings->per_rank, options_.job_secret, &why_not)) {
    if (settings->per_rank) EFDL_LOG_INFO("no peer copy of this node's snapshots: {}", why_not);
    return;
  }
  PeerCopyOptions o;
  o.job_id = options_.job_id;
  o.holder = snapshots_.holder();
  o.shm_dir = snapshot::ShmDir(getenv(envvar::kShmDir));
  o.secret = options_.job_secret;
  o.listen_addr = options_.advertise_addr;
  o.min_interval = settings->min_interval;
  auto started = PeerCopy::Start(std::move(o));
  if (!started.ok()) {
    EFDL_LOG_WARN("{}; this node keeps no peer copy", started.status().message());
    return;
  }
  peer_copy_ = std::move(started).value();
  rdzv_.OfferPeerCopy(peer_copy_->port());
}

}  // namespace efdl::agent
