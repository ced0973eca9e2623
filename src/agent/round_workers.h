// RoundWorkers: the workers of this node's current round (issue #31 step 1; docs/agent.md). It
// owns the control socket they talk to (ControlServer, in a private directory unless a path is
// given) and the books of what they report on it (ControlChannel, round_reports.h), the round's
// WorkerGroup, the groups of earlier rounds still exiting after their final
// snapshot (retiring), the rank-0 node's Horovod Gloo rendezvous server of the round, and the
// round changes of those workers: stop, pause in-process at a round's close, continue in-process
// at the next (docs/control-protocol.md). It also keeps what their exits said: the output of the
// last group stopped (stderr tail, a peer-connect error), a rank that returned while the others
// trained, the round in which all of them exited 0.
//
// It decides nothing about failures or rounds: the Agent tells it when to start, stop, pause and
// continue, and judges what it reports (blame, counting, exclusion).
//
// Single-threaded: called from the Agent's loop (the control socket's thread is its own).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/control_server.h"
#include "agent/round_reports.h"
#include "agent/worker_group.h"
#include "common/net.h"
#include "efdl/status.h"
#include "rendezvous/rendezvous.h"

namespace efdl::horovod {
class RendezvousServer;
}  // namespace efdl::horovod

namespace efdl::agent {

class RoundWorkers {
 public:
  struct Config {
    std::string job_id;
    std::string node_id;
    // Empty: control.sock in a private temporary directory (removed with this object).
    std::string control_socket_path;
    std::chrono::milliseconds stop_grace{std::chrono::seconds(10)};
    // `efdl run --launcher`: one process stands for the node's workers; it is never paused
    // in-process and its returns are not told.
    bool launcher = false;
    std::string job_secret;   // the Horovod rendezvous' round token is derived from it
  };
  // What the last group Stop() stopped (and reaped) left to explain a failure.
  struct LastStop {
    std::vector<std::string> failure_tail;          // the failing rank's last stderr lines
    std::optional<PeerConnectError> connect_error;  // a worker's line about a peer, if any
  };
  // How long a worker that exits by itself is waited for (WaitForOwnExits, AwaitOwnExit0).
  static constexpr std::chrono::milliseconds kOwnExitWait{1000};

  explicit RoundWorkers(Config config);
  ~RoundWorkers();   // Close()
  RoundWorkers(const RoundWorkers&) = delete;
  RoundWorkers& operator=(const RoundWorkers&) = delete;

  // Creates the control socket (first removing directories that SIGKILLed agents left in
  // $TMPDIR, when it makes its own). An error says why it cannot.
  Status OpenControl();
  // The control socket's path once opened (empty before).
  const std::string& socket_path() const {
    static const std::string kNone;
    return control_ ? control_->path() : kNone;
  }
  // Once opened: the transport, and the channel that keeps the books of its reports.
  ControlServer& control() { return *control_; }
  ControlChannel& channel() { return *channel_; }

  // The round's group (nullptr: no workers of this node run, or they ended), and whether it is
  // paused in-process at the close of its round.
  WorkerGroup* group() const { return group_.get(); }
  bool paused() const { return paused_; }
  // Workers that run their round: a group that is not paused.
  bool active() const { return group_ && !paused_; }

  // A round reached this node: its control socket welcomes only that round's workers.
  void SetRound(int64_t round);
  // The round's workers started.
  void Started(std::unique_ptr<WorkerGroup> group);
  // The rank-0 node serves Horovod's Gloo rendezvous for round `a` (docs/horovod.md): the
  // server lives exactly as long as the round's workers. Any earlier one ends first.
  void StartHorovodRendezvous(const rdzv::Assignment& a);
  // Every worker of the group exited 0: it is forgotten.
  void Succeeded();

  // Stops the round's workers (and its Horovod server); `release_after_snapshot` (a graceful
  // round change): returns once each worker exited or reported its final snapshot without a
  // GPU; those still exiting are retiring then. `terminate_now`: local ranks that get SIGTERM at
  // once (WorkerGroup::Stop). A group stopped to the end leaves last_stop().
  void Stop(bool graceful, const std::string& reason, bool release_after_snapshot = false,
            const std::vector<int>& terminate_now = {});
  const LastStop& last_stop() const { return last_stop_; }
  // Reaps retiring workers that exited and escalates the stop of the others; with `wait`, until
  // none is left.
  void Retire(bool wait);
  // Each loop turn: the retiring groups, and about every second the processes a worker left
  // behind (adopted by this subreaper).
  void Maintain();
  // Stops everything (retiring groups waited for) and closes the control socket; idempotent.
  // Close the group first (StopAll) where something else still answers through the socket.
  void StopAll();
  void Close();

  // In-process round changes (docs/control-protocol.md): at a round's close, pauses the workers
  // when every one of them takes round changes in-process; true once all paused. False: stop
  // them (the restart path); `unpaused` then holds the local ranks that did not pause within
  // the stop grace. `interrupted` is asked while waiting (a shutdown signal: give up at once).
  bool Pause(bool graceful, const std::string& reason, std::vector<int>& unpaused,
             const std::function<bool()>& interrupted);
  // At the next round `a`: gives the paused workers their place (`env_of(local_rank)`: the
  // environment a worker started for it would get; `log_paths[i]`: local rank i's --log-dir
  // file, or empty). "" when they continue; else why they cannot (this node's worker count
  // changed, a worker is gone): the caller stops them.
  std::string Continue(const rdzv::Assignment& a,
                       const std::function<std::map<std::string, std::string>(int)>& env_of,
                       const std::vector<std::string>& log_paths);

  // A rank of the group that returned (exit 0) while the others still trained: reaped so
  // (WorkerGroup::exited0_early) or, in-process, said so ("returned"); `rank_offset`: the
  // round's first global rank of this node. nullopt: none.
  std::optional<WorkerExit> EarlyExit0(int rank_offset);
  // After a failure while other workers of the group run: waits up to kOwnExitWait for them to
  // exit by themselves; the first that exited 0, if any.
  std::optional<WorkerExit> AwaitOwnExit0();
  // At a round's close that was not graceful, before the stop's signals: whether a worker
  // exited by itself (it waits up to kOwnExitWait for a first exit, and as long again for the
  // rest, returning at once when one fails).
  bool WaitForOwnExits();
  // In-process: the round whose workers all said "returned", once per round (never for a
  // paused group or --launcher). nullopt: not (yet).
  std::optional<int64_t> AllReturned();

  // The round this node's workers all exited 0 in (or all said "returned") and their ranks
  // ("rank 1", "ranks 2..3"), until the next round starts (issue #32, blame).
  using Exited0 = std::pair<int64_t, std::string>;
  const std::optional<Exited0>& exited0() const { return exited0_; }
  void SetExited0(Exited0 e) { exited0_ = std::move(e); }
  void ForgetExited0() { exited0_.reset(); }

 private:
  // 12 members: the config, the control socket (its directory, the server, the books of its
  // reports), the group and its pause, the retiring groups, the Horovod server, what the exits
  // said (returned, last stop, exited 0), the next orphan reap.
  const Config config_;
  TempDir socket_dir_;
  std::unique_ptr<ControlServer> control_;
  std::unique_ptr<ControlChannel> channel_;   // over control_
  std::unique_ptr<WorkerGroup> group_;
  bool paused_ = false;
  // Workers of earlier rounds that took their final snapshot and are still exiting, while the
  // next round's run (StopPolicy::release_after_snapshot).
  std::vector<std::unique_ptr<WorkerGroup>> retiring_;
  std::unique_ptr<horovod::RendezvousServer> horovod_server_;   // rank-0 node, current round
  int64_t returned_noted_ = -1;   // the round AllReturned said
  LastStop last_stop_;
  std::optional<Exited0> exited0_;
  std::chrono::steady_clock::time_point next_orphan_reap_{};
};

}  // namespace efdl::agent
