#include "agent/spare_pool.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "common/env_names.h"
#include "common/log.h"

extern char** environ;

namespace efdl::agent {

namespace {

using Clock = std::chrono::steady_clock;

// Interpreter options that change nothing a spare could get wrong; with an argument: -W, -X.
bool HarmlessFlag(std::string_view arg) {
  static constexpr std::array<std::string_view, 8> kFlags = {"-u", "-B", "-O", "-OO",
                                                             "-b", "-bb", "-q", "-s"};
  for (std::string_view f : kFlags) {
    if (arg == f) return true;
  }
  return false;
}

// The environment Subprocess::Spawn builds: ours with `add` on top.
std::map<std::string, std::string> MergedEnvironment(
    const std::map<std::string, std::string>& add) {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    size_t eq = kv.find('=');
    if (eq != std::string_view::npos) {
      env[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
    }
  }
  for (const auto& [k, v] : add) env[k] = v;
  return env;
}

std::map<std::string, std::string> StartupPart(const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : env) {
    if (!IsRoundVariable(k)) out.emplace(k, v);
  }
  return out;
}

// Whether a process started with `ours + started_with` sees, for every variable that is not a
// round variable, what a worker spawned with `ours + wanted` would.
bool SameStartup(const std::map<std::string, std::string>& started_with,
                 const std::map<std::string, std::string>& wanted) {
  auto effective = [](const std::map<std::string, std::string>& add,
                      const std::string& k) -> std::optional<std::string> {
    if (auto it = add.find(k); it != add.end()) return it->second;
    if (const char* v = std::getenv(k.c_str())) return std::string(v);
    return std::nullopt;
  };
  for (const auto* side : {&started_with, &wanted}) {
    for (const auto& [k, v] : *side) {
      if (IsRoundVariable(k)) continue;
      if (effective(started_with, k) != effective(wanted, k)) return false;
    }
  }
  return true;
}

}  // namespace

std::optional<PythonCommand> ParsePythonCommand(const std::vector<std::string>& argv) {
  if (argv.empty()) return std::nullopt;
  static const std::regex kPython(R"(python(\d+(\.\d+)?)?)");
  if (!std::regex_match(std::filesystem::path(argv[0]).filename().string(), kPython)) {
    return std::nullopt;
  }
  PythonCommand cmd;
  cmd.interpreter.push_back(argv[0]);
  size_t i = 1;
  for (; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.empty() || a[0] != '-' || a == "-m") break;
    if (HarmlessFlag(a)) {
      cmd.interpreter.push_back(a);
    } else if ((a == "-W" || a == "-X") && i + 1 < argv.size()) {
      cmd.interpreter.push_back(a);
      cmd.interpreter.push_back(argv[++i]);
    } else if (a.size() > 2 && (a.starts_with("-W") || a.starts_with("-X"))) {
      cmd.interpreter.push_back(a);
    } else {
      return std::nullopt;  // -c, -, -I, -E, -S, ...: run it the ordinary way
    }
  }
  if (i >= argv.size()) return std::nullopt;
  if (argv[i] == "-m" && i + 1 >= argv.size()) return std::nullopt;
  cmd.program.assign(argv.begin() + static_cast<std::ptrdiff_t>(i), argv.end());
  return cmd;
}

bool IsRoundVariable(std::string_view name) {
  static constexpr std::array<std::string_view, 13> kNames = {
      envvar::kRank,           envvar::kLocalRank,      envvar::kWorldSize,
      envvar::kLocalWorldSize, envvar::kGroupRank,      envvar::kNodeRank,
      envvar::kNnodes,         envvar::kGroupWorldSize, envvar::kRoleName,
      envvar::kRoleRank,       envvar::kRoleWorldSize,  envvar::kMasterAddr,
      envvar::kMasterPort};
  for (std::string_view n : kNames) {
    if (name == n) return true;
  }
  return name.starts_with("EFDL_") || name.starts_with("TORCHELASTIC_") ||
         name.starts_with("HOROVOD_");
}

Result<std::unique_ptr<SparePool>> SparePool::Create(SparePoolOptions options) {
  auto cmd = ParsePythonCommand(options.command);
  if (!cmd) {
    return Status::InvalidArgument(
        "pre-started workers need a python command ('python3 [-u] SCRIPT ...' or 'python3 -m "
        "MODULE ...'); run with --no-prestart");
  }
  if (options.nproc < 1) return Status::InvalidArgument("spare pool: nproc must be >= 1");
  std::unique_ptr<SparePool> pool(new SparePool(std::move(options), std::move(*cmd)));
  pool->FindPackage();
  return pool;
}

void SparePool::FindPackage() {
  const std::string& interpreter = cmd_.interpreter.front();
  auto facts = ProbeInterpreter(cmd_.interpreter, zygote_env_, std::chrono::seconds(10));
  if (!facts.ok()) {
    Say(fmt::format("pre-started workers: cannot ask the worker's interpreter {} where it finds "
                    "efdl ({}); starting them with its own path",
                    interpreter, facts.status().message()));
    return;
  }
  PackageChoice choice =
      ChoosePackageDir(*facts, KnownPackageDirs(facts->version), interpreter, SourcePythonDir());
  if (!choice.problem.empty()) {
    // Said once, as a warning whether or not the user asked for spares: the node pays for it at
    // every round change.
    off_reason_ = std::move(choice.problem);
    EFDL_LOG_WARN("no pre-started workers on this node: {}", off_reason_);
    enabled_ = false;
    for (Slot& s : slots_) s.due.reset();
    return;
  }
  if (!choice.python_dir.empty()) {
    preload_path_ = std::move(choice.python_dir);
    EFDL_LOG_INFO("pre-started workers: the worker's interpreter {} (Python {}) cannot import "
                  "efdl by itself; its zygote is given the package in {} (the program's own "
                  "sys.path and PYTHONPATH stay as they are)",
                  interpreter, facts->version, preload_path_);
  }
}

std::map<std::string, std::string> SparePool::WithPreloadPath(
    std::map<std::string, std::string> env) const {
  if (preload_path_.empty()) return env;
  std::string rest;
  if (auto it = env.find(envvar::kPythonPath); it != env.end()) {
    rest = it->second;
  } else if (const char* v = std::getenv(envvar::kPythonPath)) {
    rest = v;
  }
  env[envvar::kPythonPath] = rest.empty() ? preload_path_ : preload_path_ + ":" + rest;
  env[kPreloadPathVariable] = preload_path_;
  return env;
}

SparePool::SparePool(SparePoolOptions options, PythonCommand cmd)
    : options_(std::move(options)), cmd_(std::move(cmd)), slots_(options_.nproc),
      learned_(options_.imports_dir) {
  for (Slot& s : slots_) s.due = Clock::now();
  if (auto it = options_.start_env.find(0); it != options_.start_env.end()) {
    zygote_env_ = it->second;
  }
}

SparePool::~SparePool() { Clear(); }

void SparePool::Discard(Slot& slot) {
  if (slot.message_fd >= 0) {
    ::close(slot.message_fd);
    slot.message_fd = -1;
  }
  if (slot.ready_fd >= 0) {
    ::close(slot.ready_fd);
    slot.ready_fd = -1;
  }
  if (slot.proc) {
    (void)slot.proc->Signal(SIGKILL);
    (void)slot.proc->Stop(std::chrono::milliseconds(0));
    slot.proc.reset();
  }
}

void SparePool::Clear() {
  for (Slot& s : slots_) {
    Discard(s);
    s.due.reset();
  }
}

void SparePool::Say(const std::string& line) const {
  if (options_.requested) {
    EFDL_LOG_WARN("{}", line);
  } else {
    EFDL_LOG_INFO("{}", line);
  }
}

void SparePool::Disable(const std::string& line) {
  Say(line);
  off_reason_ = line;
  zygote_.reset();
  Clear();
  enabled_ = false;
}

void SparePool::ZygoteFailed(const Status& why) {
  Say(fmt::format("{}; starting each pre-started worker as its own interpreter",
                  why.message()));
  zygote_.reset();
  zygote_ready_ = false;
  zygote_off_ = true;
}

bool SparePool::ZygoteSettled() {
  if (!options_.zygote || zygote_off_) return true;
  if (!zygote_) {
    auto z = Zygote::Start({cmd_.interpreter, WithPreloadPath(zygote_env_), options_.reaper});
    if (!z.ok()) {
      ZygoteFailed(z.status());
      return true;
    }
    zygote_ = std::move(z).value();
    learned_.NewZygote();   // the learned imports go to it once it is ready
  }
  if (std::vector<std::string> more = zygote_ready_ ? learned_.Unsent()
                                                    : std::vector<std::string>{};
      !more.empty()) {
    if (zygote_->Import(more).ok()) {
      Say(fmt::format("pre-started workers: the zygote imports {} more module(s) the program "
                      "imported ({}{}; --no-learn-imports turns this off)",
                      more.size(), fmt::join(more.begin(), more.begin() + std::min<size_t>(
                                                                           more.size(), 5), ", "),
                      more.size() > 5 ? ", ..." : ""));
      learned_.Sent(Clock::now());
      zygote_ready_ = false;
    }   // else it is gone: noticed below
  }
  if (learned_.awaiting()) {   // its answer, or its end, to the import request
    zygote_->DrainOutput();
    auto answer = zygote_->Ready();
    if (answer.ok() && !*answer) return false;
    return ImportAnswered(answer) || ZygoteSettled();
  }
  if (zygote_ready_) {
    zygote_->DrainOutput();
    const std::optional<int> exit = zygote_->Exited();
    if (!exit) return true;
    // Killed after its imports (the OOM killer, a stray signal): its spares already forked live
    // on; a new zygote imports again. One that keeps dying is given up for started spares.
    const pid_t pid = zygote_->pid();
    zygote_.reset();
    zygote_ready_ = false;
    if (++zygote_restarts_ > kMaxZygoteRestarts) {
      ZygoteFailed(Status::Unavailable(fmt::format(
          "the zygote (pid {}) ended ({}) again after {} restarts", pid, DescribeWaitStatus(*exit),
          kMaxZygoteRestarts)));
      return true;
    }
    Say(fmt::format("pre-started workers: the zygote (pid {}) ended ({}); starting a new one "
                    "(restart {} of {})",
                    pid, DescribeWaitStatus(*exit), zygote_restarts_, kMaxZygoteRestarts));
    return ZygoteSettled();
  }
  auto ready = zygote_->Ready();
  if (ready.ok()) {
    zygote_ready_ = *ready;
    return zygote_ready_;
  }
  if (ready.status().IsFailedPrecondition()) {   // it refused to fork (threads): start spares
    ZygoteFailed(ready.status());
    return true;
  }
  // It died before its imports were done: a started spare would die the same way.
  Disable(fmt::format(
      "pre-started workers: {}; spawning workers from now on (no pre-started workers)",
      ready.status().message()));
  return true;
}

bool SparePool::ImportAnswered(const Result<bool>& ready) {
  const double took = learned_.Answered(Clock::now());
  if (ready.ok()) {
    zygote_ready_ = true;
    // The idle spares were forked without those modules: fork them again.
    int again = 0;
    for (Slot& s : slots_) {
      if (!s.proc) continue;
      Discard(s);
      s.due = Clock::now();
      ++again;
    }
    Say(fmt::format("pre-started workers: the zygote imported them in {:.2f} s; {} idle spare(s) "
                    "forked again", took, again));
    return true;
  }
  learned_.TurnOff();
  zygote_.reset();
  zygote_ready_ = false;
  Say(fmt::format("pre-started workers: {}; a new zygote imports without them (no more "
                  "learning of the program's imports)", ready.status().message()));
  return false;
}

bool SparePool::ForksFor(int local_rank) const {
  if (!zygote_ || (!zygote_ready_ && !learned_.awaiting())) return false;
  auto it = options_.start_env.find(local_rank);
  return SameStartup(zygote_env_, it != options_.start_env.end()
                                      ? it->second
                                      : std::map<std::string, std::string>{});
}

std::optional<pid_t> SparePool::zygote_pid() const {
  if (!zygote_) return std::nullopt;
  return zygote_->pid();
}

Status SparePool::StartSpare(int local_rank, Slot& slot) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return Status::IOError(fmt::format("pipe: {}", std::strerror(errno)));
  }
  int ready[2];
  if (::pipe2(ready, O_CLOEXEC | O_NONBLOCK) != 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return Status::IOError(fmt::format("pipe: {}", std::strerror(errno)));
  }
  SpawnOptions so;
  if (auto it = options_.start_env.find(local_rank); it != options_.start_env.end()) {
    so.env_set = it->second;
  }
  if (ForksFor(local_rank)) {
    int out[2] = {-1, -1}, err[2] = {-1, -1};
    if (::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0) {
      auto proc = zygote_->Fork(so.env_set, {fds[0], ready[1], out[1], err[1]}, out[0], err[0]);
      if (proc.ok()) {
        slot.proc = std::move(proc).value();
        slot.message_fd = fds[1];
        slot.ready_fd = ready[0];
        slot.started_with = so.env_set;
        slot.due.reset();
        EFDL_LOG_DEBUG("forked a worker for local rank {} from the zygote (pid {})", local_rank,
                       slot.proc->pid());
        return Status::OK();
      }
      ZygoteFailed(proc.status());   // Fork closed the pipe ends it was given
    } else {
      for (int fd : {out[0], out[1], err[0], err[1], fds[0], ready[1]}) {
        if (fd >= 0) ::close(fd);
      }
      ZygoteFailed(Status::IOError(fmt::format("pipe: {}", std::strerror(errno))));
    }
    ::close(fds[1]);
    ::close(ready[0]);
    return StartSpare(local_rank, slot);
  }
  const std::map<std::string, std::string> started_with = so.env_set;
  so.env_set = WithPreloadPath(std::move(so.env_set));
  so.argv = cmd_.interpreter;
  so.argv.insert(so.argv.end(),
                 {"-m", "efdl.preload", std::to_string(fds[0]), std::to_string(ready[1])});
  so.stdout_mode = SpawnOptions::Stdio::kPipe;
  so.stderr_mode = SpawnOptions::Stdio::kPipe;
  so.new_process_group = true;
  so.die_with_parent = true;
  so.inherit_fds = {fds[0], ready[1]};
  so.reaper = options_.reaper;
  auto proc = Subprocess::Spawn(so);
  ::close(fds[0]);
  ::close(ready[1]);
  if (!proc.ok()) {
    ::close(fds[1]);
    ::close(ready[0]);
    return proc.status();
  }
  slot.proc = std::move(proc).value();
  slot.message_fd = fds[1];
  slot.ready_fd = ready[0];
  slot.started_with = started_with;
  slot.due.reset();
  EFDL_LOG_DEBUG("pre-started a worker for local rank {} (pid {})", local_rank, slot.proc->pid());
  return Status::OK();
}

void SparePool::Maintain() {
  if (!enabled_) return;
  if (zygote_) learned_.Read(Clock::now());
  // While the zygote imports, due slots wait for its forks (cheaper than interpreters of their
  // own, which would compete with it for the CPU).
  const bool settled = ZygoteSettled();
  if (!enabled_) return;
  const auto now = Clock::now();
  for (size_t lr = 0; lr < slots_.size(); ++lr) {
    Slot& s = slots_[lr];
    if (s.proc) {
      auto st = s.proc->Poll();
      if (!st) continue;
      // A spare only ends on its own when it cannot work at all; retrying would spin.
      std::string err = ReadAvailable(s.proc->stderr_fd(), 2048);
      while (!err.empty() && err.back() == '\n') err.pop_back();
      const std::string line = fmt::format(
          "pre-started worker for local rank {} {} before use{}{}; spawning workers from now "
          "on (no pre-started workers)",
          lr, DescribeWaitStatus(*st), err.empty() ? "" : ": ", err);
      Disable(line);
      return;
    }
    if (!s.due || now < *s.due || !settled) continue;
    if (Status st = StartSpare(static_cast<int>(lr), s); !st.ok()) {
      off_reason_ = fmt::format("cannot pre-start a worker ({}); spawning workers from now on "
                                "(no pre-started workers)", st.message());
      EFDL_LOG_WARN("{}", off_reason_);
      Clear();
      enabled_ = false;
      return;
    }
  }
}

std::optional<Subprocess> SparePool::Activate(int local_rank,
                                              const std::map<std::string, std::string>& env,
                                              int64_t round,
                                              const std::vector<std::string>& extra_args) {
  if (local_rank < 0 || static_cast<size_t>(local_rank) >= slots_.size()) return std::nullopt;
  Slot& s = slots_[static_cast<size_t>(local_rank)];
  if (enabled_) {
    s.due = Clock::now() + (ForksFor(local_rank) ? std::chrono::milliseconds(0)
                                                  : options_.refill_delay);
  }
  if (!s.proc || s.proc->Poll()) {
    Discard(s);
    return std::nullopt;
  }
  if (!SameStartup(s.started_with, env)) {
    EFDL_LOG_INFO("local rank {}: the pre-started worker has a different start-up environment; "
                  "spawning a new one",
                  local_rank);
    options_.start_env[local_rank] = StartupPart(env);
    if (zygote_ && !SameStartup(zygote_env_, options_.start_env[local_rank])) {
      // It imported with the old environment: a new zygote, with the new one, serves from now.
      zygote_.reset();
      zygote_ready_ = false;
      zygote_env_ = options_.start_env[local_rank];
    }
    Discard(s);
    return std::nullopt;
  }
  std::vector<std::string> program = cmd_.program;
  program.insert(program.end(), extra_args.begin(), extra_args.end());
  if (options_.imports_dir.empty() || !ForksFor(local_rank)) {
    return Hand(local_rank, s, round, program, env);
  }
  std::map<std::string, std::string> with_report = env;
  with_report[kImportsDirVariable] = options_.imports_dir;
  return Hand(local_rank, s, round, program, with_report);
}

std::optional<Subprocess> SparePool::ActivateProgram(const std::vector<std::string>& program,
                                                     const std::map<std::string, std::string>& env) {
  if (slots_.empty()) return std::nullopt;
  Slot& s = slots_.front();
  if (!s.proc || s.proc->Poll() || s.ready_fd >= 0) return std::nullopt;   // not warm
  if (enabled_) s.due = Clock::now();   // not a round's start: nothing competes for the CPU
  std::map<std::string, std::string> all = s.started_with;
  for (const auto& [k, v] : env) all[k] = v;
  return Hand(0, s, 0, program, all);
}

std::optional<Subprocess> SparePool::Hand(int local_rank, Slot& s, int64_t round,
                                          const std::vector<std::string>& program,
                                          const std::map<std::string, std::string>& env) {
  nlohmann::json msg = {{"round", round}, {"argv", program}, {"env", MergedEnvironment(env)}};
  const std::string text = msg.dump();
  // The spare may still be importing: the whole message must fit in the pipe, never block.
  if (text.size() > 65536) {
    (void)::fcntl(s.message_fd, F_SETPIPE_SZ, static_cast<int>(text.size()));
  }
  ::fcntl(s.message_fd, F_SETFL, ::fcntl(s.message_fd, F_GETFL) | O_NONBLOCK);
  size_t off = 0;
  while (off < text.size()) {
    ssize_t n = ::write(s.message_fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  if (off < text.size()) {
    EFDL_LOG_WARN("local rank {}: cannot hand the round to the pre-started worker ({}); "
                  "spawning a new one",
                  local_rank, off == 0 && errno != EAGAIN ? std::strerror(errno)
                                                          : "message too large for its pipe");
    Discard(s);
    return std::nullopt;
  }
  ::close(s.message_fd);  // end of message
  s.message_fd = -1;
  std::optional<Subprocess> out = std::move(s.proc);
  s.proc.reset();
  return out;
}

size_t SparePool::Importing() {
  size_t n = 0;
  bool died = false;
  if (zygote_ && !zygote_ready_) {   // its forks are the spares still to come
    for (const Slot& s : slots_) n += s.proc ? 0 : 1;
  }
  for (Slot& s : slots_) {
    if (!s.proc || s.ready_fd < 0) continue;
    char byte = 0;
    ssize_t r = ::read(s.ready_fd, &byte, 1);
    if (r < 0 && errno == EINTR) r = ::read(s.ready_fd, &byte, 1);
    if (r < 0 && errno == EAGAIN) {
      ++n;
      continue;
    }
    // A byte: imports done. End of file without one: the spare died or closed the pipe; either
    // way there is nothing more to wait for. A dying spare closes the pipe an instant before
    // waitpid() can see its exit: wait for that briefly, so Maintain() turns the pool off now
    // instead of the caller taking a dead spare for a ready one.
    if (r == 0 && s.proc->WaitFor(std::chrono::milliseconds(200))) died = true;
    ::close(s.ready_fd);
    s.ready_fd = -1;
  }
  if (died) Maintain();
  return n;
}

size_t SparePool::WaitUntilImported(const std::function<bool()>& interrupted) {
  Maintain();
  size_t n = Importing();
  if (n == 0) return 0;
  EFDL_LOG_INFO("waiting for {} pre-started worker(s) to import before joining", n);
  const auto start = Clock::now();
  const auto deadline = start + options_.import_timeout;
  auto seconds = [&] {
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  while (n > 0) {
    if (interrupted && interrupted()) return n;
    const auto now = Clock::now();
    if (now >= deadline) {
      EFDL_LOG_WARN("{} pre-started worker(s) still importing after {:.1f} s; joining anyway", n,
                    seconds());
      return n;
    }
    std::vector<pollfd> fds;
    for (const Slot& s : slots_) {
      if (s.proc && s.ready_fd >= 0) fds.push_back({s.ready_fd, POLLIN, 0});
    }
    if (zygote_ && !zygote_ready_) fds.push_back({zygote_->fd(), POLLIN, 0});
    // Short slices: shutdown signals and spares that die are noticed within 200 ms.
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    (void)::poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(200, left + 1)));
    Maintain();
    n = Importing();
  }
  if (enabled_) EFDL_LOG_INFO("pre-started worker(s) imported after {:.1f} s", seconds());
  return 0;
}

std::vector<pid_t> SparePool::pids() const {
  std::vector<pid_t> out;
  for (const Slot& s : slots_) {
    if (s.proc && s.proc->running()) out.push_back(s.proc->pid());
  }
  return out;
}

}  // namespace efdl::agent
