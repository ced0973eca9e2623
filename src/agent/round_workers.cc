#include "agent/round_workers.h"

#include <algorithm>
#include <cstdlib>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/stale_dirs.h"
#include "agent/zygote.h"
#include "common/log.h"
#include "horovod/rendezvous_server.h"
#include "horovod/slots.h"

namespace efdl::agent {

namespace {

// The numeric addresses of the round's members (the rank-0 node's assignment lists their
// advertise addresses), for the Gloo rendezvous server's client filter. Empty (no filter, with a
// warning) when a member's name does not resolve here: the round's token still guards it.
std::vector<std::string> HorovodClientFilter(const rdzv::Assignment& a) {
  std::vector<std::string> out;
  for (const auto& host : a.horovod_clients) {
    auto numeric = NumericAddresses(host);
    if (!numeric.ok()) {
      EFDL_LOG_WARN("round {}: {}; Horovod's Gloo rendezvous serves every client that has the "
                    "round's token this round", a.round, numeric.status().message());
      return {};
    }
    out.insert(out.end(), numeric->begin(), numeric->end());
  }
  return out;
}

// Sleeps a growing step (1 ms doubling to 10 ms) between polls.
void Backoff(std::chrono::milliseconds& step) {
  std::this_thread::sleep_for(step);
  step = std::min(step * 2, std::chrono::milliseconds(10));
}

}  // namespace

RoundWorkers::RoundWorkers(Config config) : config_(std::move(config)) {}

RoundWorkers::~RoundWorkers() { Close(); }

Status RoundWorkers::OpenControl() {
  std::string path = config_.control_socket_path;
  if (path.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    RemoveStaleAgentDirs(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp");
    auto dir = TempDir::Create("efdl-agent");
    if (!dir.ok()) return dir.status();
    socket_dir_ = std::move(dir).value();
    // Before the socket is bound: a sibling agent's start tells this live agent's directory from
    // a dead one's by it (stale_dirs.h).
    if (Status s = WriteAgentOwnerFile(socket_dir_.path()); !s.ok()) return s;
    path = socket_dir_.path() + "/control.sock";
  }
  auto control = ControlServer::Start({path, config_.job_id, config_.node_id});
  if (!control.ok()) return control.status();
  control_ = std::move(control).value();
  channel_ = std::make_unique<ControlChannel>(*control_);
  return Status::OK();
}

void RoundWorkers::SetRound(int64_t round) {
  control_->SetRound(round);
  channel_->books().ForgetBefore(round - 1);   // keeps them bounded
}

void RoundWorkers::Started(std::unique_ptr<WorkerGroup> group) {
  group_ = std::move(group);
  paused_ = false;
}

void RoundWorkers::Succeeded() {
  group_.reset();
  paused_ = false;
}

void RoundWorkers::Stop(bool graceful, const std::string& reason, bool release_after_snapshot,
                        const std::vector<int>& terminate_now) {
  horovod_server_.reset();   // the round is over for this node
  paused_ = false;
  if (!group_) return;
  const int64_t round = group_->round();
  if (group_->running() > 0) {
    EFDL_LOG_INFO("round {}: stopping {} worker(s) ({}): {}", round, group_->running(),
                  graceful ? "graceful" : "not graceful", reason);
  }
  StopPolicy policy{graceful, reason, config_.stop_grace, release_after_snapshot};
  group_->Stop(policy, channel_.get(), terminate_now);
  if (group_->running() > 0) {
    // Released after their final snapshot: only a graceful stop, whose failures count for
    // nothing and whose output explains no failure, gets here.
    EFDL_LOG_DEBUG("round {}: {} worker(s) took their final snapshot and are exiting; the next "
                   "round may start",
                   round, group_->running());
    last_stop_ = {};
    retiring_.push_back(std::move(group_));
    return;
  }
  group_->Close();   // every line of their output read: the connect error below is complete
  last_stop_.connect_error = group_->peer_connect_error();
  const auto& failed = group_->first_failure();
  last_stop_.failure_tail =
      failed ? group_->stderr_tail(failed->rank) : std::vector<std::string>{};
  group_.reset();
}

void RoundWorkers::Retire(bool wait) {
  auto step = std::chrono::milliseconds(1);
  while (!retiring_.empty()) {
    for (auto it = retiring_.begin(); it != retiring_.end();) {
      if ((*it)->Retire()) {
        (*it)->Close();
        EFDL_LOG_DEBUG("round {}: its last worker exited", (*it)->round());
        it = retiring_.erase(it);
      } else {
        ++it;
      }
    }
    if (!wait || retiring_.empty()) return;
    Backoff(step);
  }
}

void RoundWorkers::Maintain() {
  if (!retiring_.empty()) Retire(/*wait=*/false);
  if (const auto now = std::chrono::steady_clock::now(); now >= next_orphan_reap_) {
    ReapAdoptedOrphans();
    next_orphan_reap_ = now + std::chrono::seconds(1);
  }
}

void RoundWorkers::StopAll() {
  // Workers first: their stop may still talk to the control socket.
  Retire(/*wait=*/true);
  horovod_server_.reset();
  group_.reset();
  paused_ = false;
}

void RoundWorkers::Close() {
  StopAll();
  channel_.reset();
  control_.reset();
}

void RoundWorkers::StartHorovodRendezvous(const rdzv::Assignment& a) {
  horovod_server_.reset();
  if (a.standby || a.node_rank != 0 || a.horovod_port == 0 || a.horovod_hosts.empty()) return;
  std::vector<horovod::HostSlots> hosts;
  hosts.reserve(a.horovod_hosts.size());
  for (const auto& [id, nproc] : a.horovod_hosts) hosts.push_back({id, nproc});
  auto slots = horovod::AssignSlots(hosts);
  Status failed = slots.status();
  if (slots.ok()) {
    horovod::RendezvousServerOptions o;
    o.bind_addr = a.master_addr;   // this node's advertise address: never every interface
    o.port = a.horovod_port;
    // Every request must carry the round's token (from the job's secret), and where the
    // members' names resolve, also come from a member's address.
    o.allowed_clients = HorovodClientFilter(a);
    auto token = horovod::RendezvousToken(config_.job_secret, a.round);
    if (token.ok()) o.token = std::move(token).value();
    auto server = token.ok() ? horovod::RendezvousServer::Start(o, *slots)
                             : Result<std::unique_ptr<horovod::RendezvousServer>>(token.status());
    if (server.ok()) {
      horovod_server_ = std::move(server).value();
      EFDL_LOG_DEBUG("round {}: serving Horovod's Gloo rendezvous on {}:{} for {} processes",
                     a.round, a.master_addr, a.horovod_port, a.world_size);
      return;
    }
    failed = server.status();
  }
  // Only real Horovod needs the server: a torch.distributed job of this round is unaffected.
  EFDL_LOG_WARN("round {}: cannot serve Horovod's Gloo rendezvous on {}:{}: {}; real Horovod "
                "workers of this round will fail to initialise", a.round, a.master_addr,
                a.horovod_port, failed.message());
}

bool RoundWorkers::Pause(bool graceful, const std::string& reason, std::vector<int>& unpaused,
                         const std::function<bool()>& interrupted) {
  unpaused.clear();
  if (config_.launcher || !group_ || group_->size() == 0) return false;
  const int64_t round = group_->round();
  const size_t n = group_->size();
  const std::vector<int> in_process = control_->InProcessRanks(round);
  if (in_process.size() != n || group_->running() != static_cast<int>(n)) return false;
  // A worker whose program returned never pauses: it is exiting (the restart path takes over).
  if (!channel_->ReturnedRanks(round).empty()) return false;
  horovod_server_.reset();   // the round is over for this node
  control_->RequestPause(round, graceful, reason);
  EFDL_LOG_INFO("round {}: pausing {} worker(s) in-process ({}): {}", round, n,
                graceful ? "graceful" : "not graceful", reason);
  const auto start = std::chrono::steady_clock::now();
  auto step = std::chrono::milliseconds(1);
  while (true) {
    const std::vector<int> paused = channel_->PausedRanks(round);
    const std::set<int> done(paused.begin(), paused.end());
    if (done.size() >= n) break;
    if (group_->Poll() != WorkerGroup::State::kRunning) {
      EFDL_LOG_WARN("round {}: a worker exited while pausing; this node's workers are restarted",
                    round);
      return false;
    }
    if (std::chrono::steady_clock::now() - start >= config_.stop_grace) {
      for (int lr = 0; lr < static_cast<int>(n); ++lr) {
        if (done.count(lr) == 0) unpaused.push_back(lr);
      }
      EFDL_LOG_WARN("round {}: local rank(s) {} did not pause within {} ms (a collective waiting "
                    "for a frozen or cut-off peer cannot be interrupted); this node's workers "
                    "are restarted", round, fmt::join(unpaused, ", "),
                    config_.stop_grace.count());
      return false;
    }
    if (interrupted && interrupted()) return false;   // the loop shuts down next
    Backoff(step);
  }
  EFDL_LOG_INFO("round {}: {} worker(s) paused; they continue in the next round", round, n);
  paused_ = true;
  return true;
}

std::string RoundWorkers::Continue(
    const rdzv::Assignment& a,
    const std::function<std::map<std::string, std::string>(int)>& env_of,
    const std::vector<std::string>& log_paths) {
  if (!paused_ || !group_) return "no workers are paused";
  const int64_t old_round = group_->round();
  const auto n = static_cast<int>(group_->size());
  if (a.nproc != n) return fmt::format("this node runs {} worker(s) now, {} before", a.nproc, n);
  if (group_->Poll() != WorkerGroup::State::kRunning) return "a paused worker exited";
  if (static_cast<int>(control_->InProcessRanks(old_round).size()) != n) {
    return "a paused worker closed its control connection";
  }
  std::vector<int> ranks;
  for (int lr = 0; lr < n; ++lr) ranks.push_back(a.rank_offset + lr);
  group_->Renumber(a.round, ranks, log_paths);
  for (int lr = 0; lr < n; ++lr) {
    if (!control_->AssignRound(old_round, lr, a.round, a.rank_offset + lr, env_of(lr))) {
      return fmt::format("local rank {} could not be reached", lr);
    }
  }
  paused_ = false;
  return "";
}

std::optional<WorkerExit> RoundWorkers::EarlyExit0(int rank_offset) {
  if (!group_) return std::nullopt;
  if (group_->exited0_early()) return group_->exited0_early();
  // In-process, the worker says so before its exit closes its sockets: ahead of the failure of
  // the collectives that lose it, which may come before its exit is reaped.
  const std::vector<int> returned = channel_->ReturnedRanks(group_->round());
  if (returned.empty() || static_cast<int>(returned.size()) >= static_cast<int>(group_->size())) {
    return std::nullopt;   // none, or all of them: the job's end
  }
  const int local = returned.front();
  return WorkerExit{local, rank_offset + local, 0};
}

std::optional<WorkerExit> RoundWorkers::AwaitOwnExit0() {
  const auto until = std::chrono::steady_clock::now() + kOwnExitWait;
  auto step = std::chrono::milliseconds(1);
  while (group_->running() > 0 && !group_->first_exited0() &&
         std::chrono::steady_clock::now() < until) {
    Backoff(step);
    group_->Poll();
  }
  return group_->first_exited0();
}

bool RoundWorkers::WaitForOwnExits() {
  // A process whose program raised or returned closes its sockets as it tears down, and may
  // still be tearing down (its traceback, its State's last flush, torch's exit) when its peers'
  // collectives fail and the round closes: the stop's signals now would hide what it died of,
  // and the node would count nothing. Wait a little for workers that are exiting; stop at once
  // when one failed, when all exited, or when none exited by itself within kOwnExitWait.
  const auto until = std::chrono::steady_clock::now() + kOwnExitWait;
  auto step = std::chrono::milliseconds(1);
  while (true) {
    const WorkerGroup::State st = group_->Poll();
    const bool some = group_->running() < static_cast<int>(group_->size());
    if (st != WorkerGroup::State::kRunning) return true;
    if (!some && std::chrono::steady_clock::now() >= until) return false;
    if (std::chrono::steady_clock::now() >= until + kOwnExitWait) return some;
    Backoff(step);
  }
}

std::optional<int64_t> RoundWorkers::AllReturned() {
  if (!group_ || paused_ || config_.launcher) return std::nullopt;
  const int64_t round = group_->round();
  if (returned_noted_ == round) return std::nullopt;
  const std::vector<int> returned = channel_->ReturnedRanks(round);
  if (std::set<int>(returned.begin(), returned.end()).size() < group_->size()) return std::nullopt;
  returned_noted_ = round;
  return round;
}

}  // namespace efdl::agent
