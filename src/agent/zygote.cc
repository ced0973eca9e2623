#include "agent/zygote.h"

#include <dirent.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "common/log.h"

namespace efdl::agent {
namespace {

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

void CloseAll(SpareDescriptors& fds) {
  CloseFd(fds.message_read);
  CloseFd(fds.ready_write);
  CloseFd(fds.stdout_write);
  CloseFd(fds.stderr_write);
}

// One packet from the zygote, waiting up to `timeout`: nullopt on a timeout; "" at end of file.
Result<std::optional<std::string>> Receive(int sock, std::chrono::milliseconds timeout) {
  pollfd p{sock, POLLIN, 0};
  int rc;
  do {
    rc = ::poll(&p, 1, static_cast<int>(timeout.count()));
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) return Status::IOError(fmt::format("poll: {}", std::strerror(errno)));
  if (rc == 0) return std::optional<std::string>();
  std::string buf(1 << 16, '\0');
  ssize_t n;
  do {
    n = ::recv(sock, buf.data(), buf.size(), 0);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && errno != ECONNRESET) {
    return Status::IOError(fmt::format("recv: {}", std::strerror(errno)));
  }
  buf.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return std::optional<std::string>(std::move(buf));
}

// The state letter and the process group of /proc/<pid>/stat ("pid (comm) S ppid pgrp ...").
bool ReadStat(pid_t pid, char& state, pid_t& ppid, pid_t& pgrp) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');   // comm may hold blanks and parentheses
  if (close == std::string::npos) return false;
  std::istringstream rest(text.substr(close + 1));
  return static_cast<bool>(rest >> state >> ppid >> pgrp);
}

// This process's children: /proc/self/task/*/children, or a scan of /proc where the kernel
// lacks that file.
std::vector<pid_t> Children() {
  std::vector<pid_t> out;
  bool listed = false;
  if (DIR* tasks = ::opendir("/proc/self/task")) {
    while (dirent* t = ::readdir(tasks)) {
      if (t->d_name[0] == '.') continue;
      std::ifstream in(fmt::format("/proc/self/task/{}/children", t->d_name));
      if (!in) continue;
      listed = true;
      pid_t pid;
      while (in >> pid) out.push_back(pid);
    }
    ::closedir(tasks);
  }
  if (listed) return out;
  const pid_t self = ::getpid();
  if (DIR* proc = ::opendir("/proc")) {
    while (dirent* e = ::readdir(proc)) {
      char* end = nullptr;
      const long pid = std::strtol(e->d_name, &end, 10);
      if (pid <= 0 || *end != '\0') continue;
      char state;
      pid_t ppid, pgrp;
      if (ReadStat(static_cast<pid_t>(pid), state, ppid, pgrp) && ppid == self) {
        out.push_back(static_cast<pid_t>(pid));
      }
    }
    ::closedir(proc);
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<Zygote>> Zygote::Start(ZygoteOptions options) {
  int subreaper = 0;
  if (::prctl(PR_GET_CHILD_SUBREAPER, &subreaper) != 0 || subreaper == 0) {
    return Status::FailedPrecondition(
        "a zygote's spares are adopted by the agent, which must be a child subreaper "
        "(PR_SET_CHILD_SUBREAPER)");
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    return Status::IOError(fmt::format("socketpair: {}", std::strerror(errno)));
  }
  SpawnOptions so;
  so.argv = options.interpreter;
  so.argv.insert(so.argv.end(), {"-m", "efdl.preload", "--zygote", std::to_string(sv[1])});
  so.env_set = options.env_set;
  so.stdout_mode = SpawnOptions::Stdio::kNull;
  so.stderr_mode = SpawnOptions::Stdio::kPipe;
  so.new_process_group = true;
  so.die_with_parent = true;
  so.inherit_fds = {sv[1]};
  so.reaper = options.reaper;
  auto proc = Subprocess::Spawn(so);
  ::close(sv[1]);
  if (!proc.ok()) {
    ::close(sv[0]);
    return proc.status().WithContext("cannot start the zygote");
  }
  EFDL_LOG_DEBUG("started the zygote (pid {})", proc->pid());
  return std::unique_ptr<Zygote>(new Zygote(std::move(options), std::move(proc).value(), sv[0]));
}

Zygote::~Zygote() {
  CloseFd(sock_);   // the zygote ends at end of file
  if (proc_.running() && !proc_.WaitFor(std::chrono::milliseconds(500))) {
    (void)proc_.Stop(std::chrono::milliseconds(0));
  }
}

void Zygote::DrainOutput() {
  for (const auto& line : stderr_lines_.Feed(ReadAvailable(proc_.stderr_fd(), 1 << 16))) {
    EFDL_LOG_INFO("zygote (pid {}): {}", proc_.pid(), line);
  }
}

Status Zygote::Died(const std::string& what) {
  std::string detail;
  if (auto st = proc_.WaitFor(std::chrono::milliseconds(200))) {
    detail = DescribeWaitStatus(*st);
  } else {
    (void)proc_.Stop(std::chrono::milliseconds(0));
    detail = "was stopped";
  }
  // Its last stderr line (an import error, a traceback's last line) says why.
  std::string err = stderr_lines_.TakeRest() + ReadAvailable(proc_.stderr_fd(), 1 << 16);
  while (!err.empty() && err.back() == '\n') err.pop_back();
  if (size_t nl = err.rfind('\n'); nl != std::string::npos) err.erase(0, nl + 1);
  return Status::Unavailable(fmt::format("the zygote {} ({}){}{}", what, detail,
                                         err.empty() ? "" : ": ", err));
}

Result<bool> Zygote::Ready() {
  if (ready_) return true;
  auto got = Receive(sock_, std::chrono::milliseconds(0));
  if (!got.ok()) return got.status();
  if (!got->has_value()) return false;
  if ((*got)->empty()) return Died("exited before its imports were done");
  auto msg = nlohmann::json::parse(**got, nullptr, false);
  if (msg.is_object() && msg.value("ready", false)) {
    ready_ = true;
    return true;
  }
  const std::string why = msg.is_object() && msg.contains("error") && msg["error"].is_string()
                              ? msg["error"].get<std::string>()
                              : "sent an unreadable message";
  // A refusal (FailedPrecondition) leaves started spares possible; a death does not.
  return Status::FailedPrecondition(Died("refused to serve: " + why).message());
}

Status Zygote::Import(const std::vector<std::string>& modules) {
  if (!ready_) return Status::FailedPrecondition("the zygote is not ready");
  const std::string text = nlohmann::json{{"import", modules}}.dump();
  ssize_t sent;
  do {
    sent = ::send(sock_, text.data(), text.size(), MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent < 0) {
    return errno == EPIPE || errno == ECONNRESET
               ? Died("is gone")
               : Status::IOError(fmt::format("send: {}", std::strerror(errno)));
  }
  ready_ = false;
  return Status::OK();
}

Result<Subprocess> Zygote::Fork(const std::map<std::string, std::string>& env,
                                SpareDescriptors fds, int stdout_read, int stderr_read) {
  auto fail = [&](Status s) -> Result<Subprocess> {
    CloseAll(fds);
    CloseFd(stdout_read);
    CloseFd(stderr_read);
    return s;
  };
  if (!ready_) return fail(Status::FailedPrecondition("the zygote is not ready"));
  const std::string text = nlohmann::json{{"env", env}}.dump();
  const int passed[4] = {fds.message_read, fds.ready_write, fds.stdout_write, fds.stderr_write};
  iovec iov{const_cast<char*>(text.data()), text.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(passed))] = {};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof(control);
  cmsghdr* cm = CMSG_FIRSTHDR(&mh);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(passed));
  std::memcpy(CMSG_DATA(cm), passed, sizeof(passed));
  ssize_t sent;
  do {
    sent = ::sendmsg(sock_, &mh, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  CloseAll(fds);   // the zygote has its own copies now (or none: it is gone)
  if (sent < 0) {
    return fail(errno == EPIPE || errno == ECONNRESET ? Died("is gone")
                                                      : Status::IOError(fmt::format(
                                                            "sendmsg: {}", std::strerror(errno))));
  }
  auto got = Receive(sock_, options_.fork_timeout);
  if (!got.ok()) return fail(got.status());
  if (!got->has_value()) {
    return fail(Status::DeadlineExceeded(fmt::format(
        "the zygote did not answer a fork request within {} ms", options_.fork_timeout.count())));
  }
  if ((*got)->empty()) return fail(Died("ended while forking a spare"));
  auto msg = nlohmann::json::parse(**got, nullptr, false);
  if (!msg.is_object() || !msg.contains("pid") || !msg["pid"].is_number_integer()) {
    const bool has_error = msg.is_object() && msg.contains("error") && msg["error"].is_string();
    return fail(Status::Unavailable(has_error ? msg["error"].get<std::string>()
                                              : "the zygote sent an unreadable answer"));
  }
  const pid_t pid = msg["pid"].get<pid_t>();
  char state;
  pid_t ppid = 0, pgrp = 0;
  if (!ReadStat(pid, state, ppid, pgrp) || ppid != ::getpid() || pgrp != pid) {
    // Not ours to wait for (or already gone and reaped by someone else): do not adopt it.
    return fail(Status::Internal(fmt::format(
        "the zygote's spare {} is not a child of this process leading its own group (parent "
        "{}, group {})", pid, ppid, pgrp)));
  }
  return Subprocess::Adopt(pid, std::exchange(stdout_read, -1), std::exchange(stderr_read, -1),
                           options_.reaper);
}

namespace {

// What ProbeInterpreter runs: one JSON line (Python 3 only; find_spec imports nothing).
constexpr const char* kProbe =
    "import importlib.machinery, importlib.util, json, sys\n"
    "print(json.dumps({'version': '%d.%d' % sys.version_info[:2],\n"
    "                  'suffixes': importlib.machinery.EXTENSION_SUFFIXES,\n"
    "                  'efdl': importlib.util.find_spec('efdl') is not None}))\n";

// The _efdl*.so files of the package in `python_dir` (file names).
std::vector<std::string> ExtensionFiles(const std::string& python_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(python_dir + "/efdl", ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("_efdl.") && name.ends_with(".so")) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// "3.11" for "_efdl.cpython-311-x86_64-linux-gnu.so"; "" when the name does not say.
std::string PythonVersionOf(const std::string& extension_file) {
  static const std::regex kTag(R"(\.cpython-(\d)(\d+)[-.])");
  std::smatch m;
  if (!std::regex_search(extension_file, m, kTag)) return "";
  return m[1].str() + "." + m[2].str();
}

bool HoldsPackage(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir + "/efdl/preload.py", ec);
}

}  // namespace

Result<InterpreterFacts> ProbeInterpreter(const std::vector<std::string>& interpreter,
                                          const std::map<std::string, std::string>& env_set,
                                          std::chrono::milliseconds timeout) {
  SpawnOptions so;
  so.argv = interpreter;
  so.argv.insert(so.argv.end(), {"-c", kProbe});
  so.env_set = env_set;
  so.stdout_mode = SpawnOptions::Stdio::kPipe;
  so.stderr_mode = SpawnOptions::Stdio::kPipe;
  auto proc = Subprocess::Spawn(so);
  if (!proc.ok()) return proc.status();
  const std::optional<int> st = proc->WaitFor(timeout);
  if (!st) {
    (void)proc->Stop(std::chrono::milliseconds(0));
    return Status::DeadlineExceeded(
        fmt::format("it did not answer within {} ms", timeout.count()));
  }
  const std::string out = ReadAvailable(proc->stdout_fd(), 1 << 16);
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (!WaitStatusSuccess(*st) || !j.is_object() || !j.contains("version") ||
      !j["version"].is_string() || !j.contains("suffixes") || !j["suffixes"].is_array() ||
      !j.contains("efdl") || !j["efdl"].is_boolean()) {
    std::string err = ReadAvailable(proc->stderr_fd(), 1 << 16);
    while (!err.empty() && err.back() == '\n') err.pop_back();
    if (size_t nl = err.rfind('\n'); nl != std::string::npos) err.erase(0, nl + 1);
    return Status::Unavailable(fmt::format("it {}{}{}", DescribeWaitStatus(*st),
                                           err.empty() ? "" : ": ", err));
  }
  InterpreterFacts facts;
  facts.version = j["version"].get<std::string>();
  for (const auto& s : j["suffixes"]) {
    if (s.is_string()) facts.extension_suffixes.push_back(s.get<std::string>());
  }
  facts.finds_efdl = j["efdl"].get<bool>();
  return facts;
}

std::string SourcePythonDir() {
#ifdef EFDL_SOURCE_PYTHON_DIR
  return HoldsPackage(EFDL_SOURCE_PYTHON_DIR) ? EFDL_SOURCE_PYTHON_DIR : "";
#else
  return "";
#endif
}

std::vector<std::string> KnownPackageDirs(const std::string& version) {
  std::vector<std::string> out;
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec && !version.empty()) {
    const auto prefix = exe.parent_path().parent_path();   // <prefix>/bin/efdl
    for (const char* kind : {"dist-packages", "site-packages"}) {
      const std::string dir = (prefix / "lib" / ("python" + version) / kind).string();
      if (HoldsPackage(dir)) out.push_back(dir);
    }
  }
  if (std::string src = SourcePythonDir(); !src.empty() &&
      std::find(out.begin(), out.end(), src) == out.end()) {
    out.push_back(std::move(src));
  }
  return out;
}

PackageChoice ChoosePackageDir(const InterpreterFacts& facts,
                               const std::vector<std::string>& known_dirs,
                               const std::string& interpreter,
                               const std::string& source_python_dir) {
  if (facts.finds_efdl) return {};
  std::vector<std::string> built;   // what the known packages were built for
  for (const std::string& dir : known_dirs) {
    const auto files = ExtensionFiles(dir);
    for (const std::string& f : files) {
      for (const std::string& suffix : facts.extension_suffixes) {
        if (f == "_efdl" + suffix) return {dir, ""};
      }
    }
    built.push_back(files.empty() ? dir + " (without its compiled part _efdl*.so: not built)"
                                  : fmt::format("{} ({})", dir, fmt::join(files, ", ")));
  }
  const std::string install =
      source_python_dir.empty()
          ? fmt::format("`{} scripts/install-python-package.py python` in EFDL's repository",
                        interpreter)
          : fmt::format("`{} {} {}`", interpreter,
                        (std::filesystem::path(source_python_dir).parent_path() / "scripts" /
                         "install-python-package.py").string(),
                        source_python_dir);
  const std::string cost =
      "every round change starts its workers cold, typically 4-5x slower per event "
      "(docs/troubleshooting.md)";
  if (built.empty()) {
    return {"", fmt::format("the worker's interpreter {} (Python {}) cannot import efdl and this "
                            "agent knows no efdl package to give it: {}; fix: install efdl into "
                            "that interpreter: {}",
                            interpreter, facts.version, cost, install)};
  }
  std::string wanted;   // the Python version the known packages load in, if they say
  for (const std::string& dir : known_dirs) {
    for (const std::string& f : ExtensionFiles(dir)) {
      if (wanted.empty()) wanted = PythonVersionOf(f);
    }
  }
  return {"", fmt::format(
                  "the worker's interpreter {} (Python {}) cannot import efdl, and the efdl "
                  "package this agent knows does not load there ({}): {}; fix: run the workers "
                  "with {} (a virtual environment made from it needs nothing more), or install "
                  "efdl into that interpreter: {} (efdl.State there also needs the extension "
                  "built for Python {}: cmake -DPython3_EXECUTABLE={})",
                  interpreter, facts.version, fmt::join(built, "; "), cost,
                  wanted.empty() ? "the Python version it was built for" : "Python " + wanted,
                  install, facts.version, interpreter)};
}

int ReapAdoptedOrphans() {
  int reaped = 0;
  for (pid_t pid : Children()) {
    char state;
    pid_t ppid, pgrp;
    if (!ReadStat(pid, state, ppid, pgrp) || state != 'Z' || pgrp == pid) continue;
    int status;
    if (::waitpid(pid, &status, WNOHANG) == pid) ++reaped;
  }
  return reaped;
}

}  // namespace efdl::agent
