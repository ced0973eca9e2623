#include "agent/worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <regex>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "agent/spare_pool.h"
#include "common/log.h"

namespace efdl::agent {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxLineBytes = 64 * 1024;  // longer lines are split, never buffered forever

void WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // the agent's own output is gone; nothing better to do
    p += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

std::optional<PeerConnectError> ParsePeerConnectError(std::string_view line) {
  // Cheap filter first: this runs on every output line of every worker.
  if (line.find("onnect") == std::string_view::npos) return std::nullopt;
  static const std::regex kPatterns[] = {
      std::regex(R"(connect \[([^\]]+)\]:(\d+): )"),                 // gloo tcp pair
      std::regex(R"(Connect to \[?([^<\s\]]+)\]?<(\d+)> failed)"),     // NCCL socket
      std::regex(R"(failed to connect to \[([^\]]+)\]:(\d+))"),        // torch store client
      std::regex(R"(trying to connect to \(([^,\s]+), (\d+)\))"),      // its timeout
  };
  const std::string text(line);
  std::smatch m;
  for (const auto& re : kPatterns) {
    if (std::regex_search(text, m, re)) {
      return PeerConnectError{0, m[1].str(), m[2].str(), text};
    }
  }
  return std::nullopt;
}

Result<std::unique_ptr<WorkerGroup>> WorkerGroup::Start(WorkerGroupOptions options) {
  if (options.argv.empty()) return Status::InvalidArgument("no worker command given");
  std::unique_ptr<WorkerGroup> group(new WorkerGroup(std::move(options)));
  const auto& opts = group->options_;
  group->round_ = opts.round;

  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    return Status::Internal(fmt::format("pipe: {}", std::strerror(errno)));
  }
  group->wake_read_ = wake[0];
  group->wake_write_ = wake[1];

  int activated = 0;
  for (const WorkerSpec& spec : opts.workers) {
    int log_fd = -1;
    if (!spec.log_path.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(spec.log_path).parent_path(), ec);
      log_fd = ::open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (log_fd < 0) {
        return Status::IOError(fmt::format("cannot open worker log file {}: {}", spec.log_path,
                                           std::strerror(errno)));
      }
    }
    std::optional<Subprocess> spare;
    if (opts.spares != nullptr) {
      spare = opts.spares->Activate(spec.local_rank, spec.env, opts.round, opts.extra_args);
    }
    Result<Subprocess> proc = Status::Internal("unset");
    if (spare) {
      proc = std::move(*spare);
      ++activated;
    } else {
      SpawnOptions so;
      so.argv = opts.argv;
      so.argv.insert(so.argv.end(), opts.extra_args.begin(), opts.extra_args.end());
      so.env_set = spec.env;
      so.stdout_mode = SpawnOptions::Stdio::kPipe;
      so.stderr_mode = SpawnOptions::Stdio::kPipe;
      so.new_process_group = true;
      so.die_with_parent = true;
      so.reaper = opts.reaper;
      proc = Subprocess::Spawn(so);
    }
    if (!proc.ok()) {
      if (log_fd >= 0) ::close(log_fd);
      return proc.status().WithContext(fmt::format("starting rank {}", spec.rank));
    }
    const size_t index = group->workers_.size();
    {
      MutexLock lock(group->connect_error_mu_);
      group->names_.push_back({spec.rank, fmt::format("[rank {}] ", spec.rank), log_fd});
    }
    int out = proc->ReleaseStdout();
    int err = proc->ReleaseStderr();
    for (int fd : {out, err}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    group->streams_.push_back(Stream{out, opts.out_fd, index, {}});
    group->streams_.push_back(Stream{err, opts.err_fd, index, {}, true});
    group->workers_.push_back(Worker{spec, std::move(proc).value(), false, std::nullopt});
  }
  if (opts.spares != nullptr) {
    EFDL_LOG_INFO("round {}: {} of {} worker(s) taken from pre-started spares", opts.round,
                  activated, opts.workers.size());
  }
  group->pump_ = std::thread([g = group.get()] { g->PumpOutput(); });
  return group;
}

WorkerGroup::~WorkerGroup() {
  Close();
  for (Stream& s : streams_) {
    if (s.fd >= 0) ::close(s.fd);
  }
  MutexLock lock(connect_error_mu_);   // the output thread is joined (Close)
  for (OutputName& name : names_) {
    if (name.log_fd >= 0) ::close(name.log_fd);
    name.log_fd = -1;
  }
  for (int fd : {wake_read_, wake_write_}) {
    if (fd >= 0) ::close(fd);
  }
}

void WorkerGroup::Close() {
  for (Worker& w : workers_) {
    if (!w.reaped) (void)w.proc.Signal(SIGKILL);
    (void)w.proc.Stop(std::chrono::milliseconds(0));  // reaps; SIGKILLs group stragglers
    w.reaped = true;
  }
  if (pump_.joinable()) {
    char byte = 0;
    ssize_t ignored = ::write(wake_write_, &byte, 1);
    (void)ignored;
    pump_.join();
  }
}

std::optional<PeerConnectError> WorkerGroup::peer_connect_error() const {
  MutexLock lock(connect_error_mu_);
  return connect_error_;
}

std::vector<std::string> WorkerGroup::stderr_tail(int rank) const {
  MutexLock lock(connect_error_mu_);
  auto it = stderr_tails_.find(rank);
  if (it == stderr_tails_.end()) return {};
  return {it->second.begin(), it->second.end()};
}

bool WorkerGroup::ReapOne(Worker& w) {
  if (w.reaped) return true;
  auto st = w.proc.Poll();
  if (!st) return false;
  w.reaped = true;
  if (!WaitStatusSuccess(*st) && !first_failure_) {
    first_failure_ = WorkerExit{w.spec.local_rank, w.spec.rank, *st};
  }
  if (WaitStatusSuccess(*st) && !first_exited0_) {
    first_exited0_ = WorkerExit{w.spec.local_rank, w.spec.rank, *st};
  }
  return true;
}

WorkerGroup::State WorkerGroup::Poll() {
  bool all_done = true;
  for (Worker& w : workers_) all_done = ReapOne(w) && all_done;
  if (first_failure_) return State::kFailed;
  if (all_done) return State::kSucceeded;
  if (!exited0_early_) {
    // Reaped (with status 0: no failure so far) while another still runs.
    for (const Worker& w : workers_) {
      if (w.reaped) {
        exited0_early_ = WorkerExit{w.spec.local_rank, w.spec.rank, 0};
        break;
      }
    }
  }
  return State::kRunning;
}

int WorkerGroup::running() const {
  int n = 0;
  for (const Worker& w : workers_) n += w.reaped ? 0 : 1;
  return n;
}

std::vector<pid_t> WorkerGroup::pids() const {
  std::vector<pid_t> out;
  for (const Worker& w : workers_) out.push_back(w.proc.pid());
  return out;
}

void WorkerGroup::Renumber(int64_t round, const std::vector<int>& ranks,
                           const std::vector<std::string>& log_paths) {
  round_ = round;
  for (size_t i = 0; i < workers_.size() && i < ranks.size(); ++i) {
    int new_fd = -1;
    if (i < log_paths.size() && !log_paths[i].empty()) {
      std::error_code ec;
      std::filesystem::create_directories(std::filesystem::path(log_paths[i]).parent_path(), ec);
      new_fd = ::open(log_paths[i].c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (new_fd < 0) {
        EFDL_LOG_WARN("cannot open worker log file {}: {}; rank {} goes on writing its old one",
                      log_paths[i], std::strerror(errno), ranks[i]);
      }
    }
    MutexLock lock(connect_error_mu_);   // EmitLine writes the log under it: none is mid-write
    workers_[i].spec.rank = ranks[i];
    OutputName& name = names_[i];
    name.rank = ranks[i];
    name.prefix = fmt::format("[rank {}] ", ranks[i]);
    if (new_fd >= 0) {
      if (name.log_fd >= 0) ::close(name.log_fd);
      name.log_fd = new_fd;
      workers_[i].spec.log_path = log_paths[i];
    }
  }
}

void WorkerGroup::Stop(const StopPolicy& policy, StopChannel* control,
                       const std::vector<int>& terminate_now) {
  stop_policy_ = policy;
  stop_start_ = Clock::now();
  // Local ranks reached over the control socket, and those that answered "stopping" in this
  // round already (one may have closed its connection on its way out): they get the grace.
  std::set<int> asked;
  if (control != nullptr) {
    for (int lr : control->RequestStop(round_, policy.graceful, policy.reason)) {
      asked.insert(lr);
    }
    for (int lr : control->StoppingRanks(round_)) asked.insert(lr);
  }
  for (int lr : terminate_now) asked.erase(lr);
  for (Worker& w : workers_) {
    if (ReapOne(w)) continue;
    if (!policy.graceful || asked.count(w.spec.local_rank) == 0) {
      (void)w.proc.Signal(SIGTERM);
      w.term_at = Clock::now();
    }
  }
  const bool may_release = policy.graceful && policy.release_after_snapshot && control != nullptr;
  auto step = std::chrono::milliseconds(1);
  while (!StopStep()) {
    if (may_release) {
      const std::vector<int> released = control->ReleasedRanks(round_);
      const std::set<int> done(released.begin(), released.end());
      bool all = true;
      for (const Worker& w : workers_) all = all && (w.reaped || done.count(w.spec.local_rank));
      if (all) return;   // Retire() finishes the stop
    }
    std::this_thread::sleep_for(step);
    step = std::min(step * 2, std::chrono::milliseconds(10));
  }
  KillGroupStragglers();
}

bool WorkerGroup::Retire() {
  if (!StopStep()) return false;
  KillGroupStragglers();
  return true;
}

bool WorkerGroup::StopStep() {
  const auto now = Clock::now();
  bool all_reaped = true;
  for (Worker& w : workers_) {
    if (ReapOne(w)) continue;
    if (!w.term_at && now - stop_start_ >= stop_policy_.grace) {
      EFDL_LOG_WARN("rank {} did not stop within {} ms of the stop request: SIGTERM",
                    w.spec.rank, stop_policy_.grace.count());
      (void)w.proc.Signal(SIGTERM);
      w.term_at = now;
    } else if (w.term_at && now - *w.term_at >= stop_policy_.grace) {
      EFDL_LOG_WARN("rank {} ignored SIGTERM for {} ms: SIGKILL", w.spec.rank,
                    stop_policy_.grace.count());
      (void)w.proc.Signal(SIGKILL);
      w.proc.Wait();
      ReapOne(w);
      continue;
    }
    all_reaped = false;
  }
  return all_reaped;
}

void WorkerGroup::KillGroupStragglers() {
  for (Worker& w : workers_) (void)w.proc.Stop(std::chrono::milliseconds(0));
}

void WorkerGroup::EmitLine(Stream& s, std::string_view line) {
  std::string out;
  int rank = 0;
  size_t prefix_size = 0;
  {
    MutexLock lock(connect_error_mu_);
    const OutputName& name = names_[s.worker];
    rank = name.rank;
    prefix_size = name.prefix.size();
    out.reserve(prefix_size + line.size() + 1);
    out.append(name.prefix);
  }
  out.append(line).push_back('\n');
  WriteAll(s.dest_fd, out.data(), out.size());  // one write per line: lines never interleave
  {
    // Under the lock: Renumber() may switch the file to the new round's (and close the old).
    MutexLock lock(connect_error_mu_);
    const int log_fd = names_[s.worker].log_fd;
    if (log_fd >= 0) WriteAll(log_fd, out.data() + prefix_size, line.size() + 1);
  }
  if (s.is_stderr) {
    MutexLock lock(connect_error_mu_);
    auto& tail = stderr_tails_[rank];
    tail.emplace_back(line.substr(0, kStderrTailChars));
    if (tail.size() > kStderrTailLines) tail.pop_front();
  }
  if (auto err = ParsePeerConnectError(line)) {
    MutexLock lock(connect_error_mu_);
    if (!connect_error_) {
      err->rank = rank;
      connect_error_ = std::move(err);
    }
  }
}

void WorkerGroup::DrainStream(Stream& s, bool final) {
  char buf[16384];
  while (s.fd >= 0) {
    ssize_t n = ::read(s.fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    if (n <= 0) {
      ::close(s.fd);
      s.fd = -1;
      break;
    }
    s.partial.append(buf, static_cast<size_t>(n));
    size_t pos = 0, nl;
    while ((nl = s.partial.find('\n', pos)) != std::string::npos) {
      EmitLine(s, std::string_view(s.partial).substr(pos, nl - pos));
      pos = nl + 1;
    }
    s.partial.erase(0, pos);
    if (s.partial.size() > kMaxLineBytes) {
      EmitLine(s, s.partial);
      s.partial.clear();
    }
  }
  if ((final || s.fd < 0) && !s.partial.empty()) {
    EmitLine(s, s.partial);
    s.partial.clear();
  }
}

void WorkerGroup::PumpOutput() {
  std::vector<pollfd> fds;
  std::vector<Stream*> owners;
  while (true) {
    fds.clear();
    owners.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    for (Stream& s : streams_) {
      if (s.fd < 0) continue;
      fds.push_back({s.fd, POLLIN, 0});
      owners.push_back(&s);
    }
    if (owners.empty()) return;  // every worker closed its output
    int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) {
      // Destruction: the workers are dead; take what is left in the pipes and stop.
      for (Stream& s : streams_) DrainStream(s, /*final=*/true);
      return;
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0) DrainStream(*owners[i - 1], /*final=*/false);
    }
  }
}

}  // namespace efdl::agent
