#include "cli/run_config.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/net.h"
#include "agent/spare_pool.h"
#include "common/subprocess.h"
#include "snapshot/arena_dir.h"

namespace efdl::cli {

namespace {

Result<int> ParsePositiveInt(std::string_view text, std::string_view what) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 1) {
    return Status::InvalidArgument(
        fmt::format("{} '{}' is not a positive whole number", what, text));
  }
  return value;
}

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000.0)));
}

// Fragmented jobs (--world-size N): the range of N; the node-level checks need the resolved
// process count and node range and are made in PlanRun.
Status CheckWorldSize(const RunFlags& f) {
  constexpr int kMaxWorldSize = 1'000'000;   // as plan::ChooseFragmentMembers
  if (f.world_size < 0 || f.world_size > kMaxWorldSize) {
    return Status::InvalidArgument(fmt::format(
        "--world-size {} is out of range: give the job's total process count, 1 to {} (0 or "
        "unset: the nodes' processes simply add up)", f.world_size, kMaxWorldSize));
  }
  return Status::OK();
}

}  // namespace

Result<NodeRange> ParseNodeRange(std::string_view spec) {
  NodeRange r;
  size_t colon = spec.find(':');
  auto bad = [&](const Status& s) {
    return Status::InvalidArgument(fmt::format(
        "--nnodes '{}': {}; expected N or MIN:MAX, e.g. --nnodes 2:4", spec, s.message()));
  };
  if (colon == std::string_view::npos) {
    auto n = ParsePositiveInt(spec, "node count");
    if (!n.ok()) return bad(n.status());
    r.min = r.max = *n;
    return r;
  }
  auto lo = ParsePositiveInt(spec.substr(0, colon), "MIN");
  if (!lo.ok()) return bad(lo.status());
  auto hi = ParsePositiveInt(spec.substr(colon + 1), "MAX");
  if (!hi.ok()) return bad(hi.status());
  if (*lo > *hi) {
    return Status::InvalidArgument(fmt::format(
        "--nnodes '{}': MIN {} is greater than MAX {}; give MIN <= MAX", spec, *lo, *hi));
  }
  r.min = *lo;
  r.max = *hi;
  return r;
}

int DefaultNprocPerNode() {
  if (const char* cvd = std::getenv("CUDA_VISIBLE_DEVICES"); cvd != nullptr) {
    std::string_view s(cvd);
    int n = 0;
    size_t start = 0;
    while (start <= s.size()) {
      size_t end = s.find(',', start);
      if (end == std::string_view::npos) end = s.size();
      std::string_view item = s.substr(start, end - start);
      if (item == "-1") break;  // CUDA stops at the first invalid index
      if (!item.empty()) ++n;
      start = end + 1;
    }
    return n > 0 ? n : 1;
  }
  int n = 0;
  if (DIR* d = ::opendir("/dev")) {
    while (dirent* e = ::readdir(d)) {
      std::string_view name(e->d_name);
      if (name.size() > 6 && name.substr(0, 6) == "nvidia" &&
          name.find_first_not_of("0123456789", 6) == std::string_view::npos) {
        ++n;
      }
    }
    ::closedir(d);
  }
  return n > 0 ? n : 1;
}

std::string DefaultNodeId() {
  std::string host;
  for (char c : HostName()) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-';
    host.push_back(ok ? c : '-');
  }
  if (host.empty() || host[0] == '-') host = "node" + host;
  if (host.size() > 100) host.resize(100);
  std::random_device rd;
  return fmt::format("{}-{}-{:04x}", host, ::getpid(), rd() & 0xffff);
}

// The program a command runs, for the job id of a run without one (the same id the program's
// State derives when run without an agent): the SCRIPT of `python3 [OPTIONS] SCRIPT ...`, ""
// for `python3 -c ...` (the current directory then), the module of `-m MODULE`, else the
// executable.
std::string JobProgram(const std::vector<std::string>& command) {
  if (command.empty()) return "";
  const std::string exe = std::filesystem::path(command[0]).filename().string();
  if (!exe.starts_with("python")) return command[0];
  for (size_t i = 1; i < command.size(); ++i) {
    const std::string& a = command[i];
    if (a == "-c") return "";
    if (a == "-m") return i + 1 < command.size() ? command[i + 1] : "";
    if (a == "-W" || a == "-X") {  // options that take the next word
      ++i;
      continue;
    }
    if (!a.starts_with("-")) return a;
  }
  return "";
}

Result<std::vector<std::string>> ParseResumeArgs(std::string_view value) {
  if (value.find_first_of("\"'\\") != std::string_view::npos) {
    return Status::InvalidArgument(fmt::format(
        "--resume-args '{}': quotes and backslashes are not interpreted (the value is split at "
        "spaces); give the arguments without them", value));
  }
  std::vector<std::string> out;
  size_t i = 0;
  while (i < value.size()) {
    const size_t start = value.find_first_not_of(" \t", i);
    if (start == std::string_view::npos) break;
    const size_t end = std::min(value.find_first_of(" \t", start), value.size());
    out.emplace_back(value.substr(start, end - start));
    i = end;
  }
  if (out.empty()) {
    return Status::InvalidArgument(
        "--resume-args is empty: give the arguments that make the program resume, e.g. "
        "--resume-args \"--init_from=resume\" (or leave the option out)");
  }
  return out;
}

namespace {
// Prints where efdl is imported from and where a `horovod` package would be (without importing
// either: find_spec of a top-level name runs none of its code).
constexpr const char* kHorovodProbe =
    "import importlib.util as u\n"
    "e = u.find_spec('efdl')\n"
    "h = u.find_spec('horovod')\n"
    "print((list(e.submodule_search_locations or []) + [''])[0] if e else '')\n"
    "print((h.origin or ','.join(h.submodule_search_locations or [])) if h else '')\n";
}  // namespace

Result<std::string> FindHorovodShim(const std::vector<std::string>& interpreter,
                                    std::chrono::milliseconds timeout) {
  const std::string who = fmt::format("{}", fmt::join(interpreter, " "));
  SpawnOptions so;
  so.argv = interpreter;
  so.argv.insert(so.argv.end(), {"-c", kHorovodProbe});
  so.stdout_mode = SpawnOptions::Stdio::kPipe;
  so.stderr_mode = SpawnOptions::Stdio::kPipe;
  auto proc = Subprocess::Spawn(so);
  if (!proc.ok()) {
    return Status::InvalidArgument(fmt::format("--horovod: cannot run {}: {}", who,
                                               proc.status().message()));
  }
  const std::optional<int> st = proc->WaitFor(timeout);
  if (!st) {
    (void)proc->Stop(std::chrono::milliseconds(0));
    return Status::InvalidArgument(fmt::format(
        "--horovod: {} did not say within {} s where it imports efdl from", who,
        timeout.count() / 1000));
  }
  const std::string out = ReadAvailable(proc->stdout_fd(), 1 << 16);
  const size_t nl = out.find('\n');
  if (!WaitStatusSuccess(*st) || nl == std::string::npos) {
    return Status::InvalidArgument(fmt::format(
        "--horovod: {} {} when asked where it imports efdl from; is it a Python 3 interpreter?",
        who, DescribeWaitStatus(*st)));
  }
  const std::string efdl_dir = out.substr(0, nl);
  std::string horovod = out.substr(nl + 1);
  while (!horovod.empty() && (horovod.back() == '\n' || horovod.back() == '\r')) {
    horovod.pop_back();
  }
  const std::filesystem::path shim = std::filesystem::path(efdl_dir) / "_horovod_shim";
  std::error_code ec;
  if (efdl_dir.empty() || !std::filesystem::is_regular_file(shim / "horovod" / "__init__.py", ec)) {
    return Status::InvalidArgument(fmt::format(
        "--horovod: {} {}; install efdl for that interpreter (make install) or put the "
        "directory holding it on PYTHONPATH", who,
        efdl_dir.empty() ? "cannot import efdl, whose stand-in for Horovod the workers import"
                         : "imports an efdl without the stand-in for Horovod (" + efdl_dir + ")"));
  }
  if (!horovod.empty() && !horovod.starts_with(shim.string() + "/")) {
    return Status::InvalidArgument(fmt::format(
        "--horovod: a real Horovod is importable by {} ({}); run without --horovod (the agent "
        "serves real Horovod's Gloo rendezvous, docs/horovod.md) or uninstall it", who, horovod));
  }
  return shim.string();
}

Result<RunPlan> PlanRun(const RunFlags& f) {
  RunPlan plan;
  if (f.command.empty()) {
    return Status::InvalidArgument(
        "no training command given: efdl run [OPTIONS] -- COMMAND [ARGS...]");
  }
  if (auto exe = FindProgram(f.command[0]); !exe.ok()) {
    return Status::InvalidArgument(fmt::format(
        "{}: give the training program as an existing command or path after '--'",
        exe.status().message()));
  }
  EFDL_RETURN_IF_ERROR(CheckWorldSize(f));
  const std::string nnodes_spec =
      !f.nnodes.empty() ? f.nnodes
      : f.world_size > 0 && !f.etcd_endpoints.empty() ? fmt::format("1:{}", f.world_size)
                         : std::string("1:1");
  EFDL_ASSIGN_OR_RETURN(NodeRange nodes, ParseNodeRange(nnodes_spec));
  if (f.world_size > 0 && nodes.max > f.world_size) {
    return Status::InvalidArgument(fmt::format(
        "--nnodes {} allows more nodes than --world-size {} has processes (each node runs at "
        "least one); give at most --nnodes {}", nnodes_spec, f.world_size, f.world_size));
  }

  plan.embedded_etcd = f.etcd_endpoints.empty();
  std::string job = f.job_id;
  if (job.empty()) {
    if (!plan.embedded_etcd) {
      return Status::InvalidArgument(
          "--job is required with --etcd: every node of a job passes the same --job ID (or "
          "sets EFDL_JOB_ID; inside a Slurm job it defaults to slurm-$SLURM_JOB_ID)");
    }
    job = snapshot::LocalJobId(JobProgram(f.command));
  }
  EFDL_RETURN_IF_ERROR(ValidateId("job id", job));
  if (plan.embedded_etcd && nodes.max > 1) {
    return Status::InvalidArgument(fmt::format(
        "--nnodes {} needs an etcd shared by the nodes: pass --etcd HOST:PORT (or set "
        "EFDL_ETCD_ENDPOINTS); without it efdl runs a single-node job", nnodes_spec));
  }
  std::string node_id = f.node_id.empty() ? DefaultNodeId() : f.node_id;
  EFDL_RETURN_IF_ERROR(ValidateId("node id", node_id));
  if (f.nproc_per_node < 0) {
    return Status::InvalidArgument(fmt::format(
        "--nproc-per-node {} is negative; give a positive count (0 or unset: one per GPU)",
        f.nproc_per_node));
  }
  // A typo such as 10000 would otherwise fork that many workers before anything else fails.
  constexpr int kMaxNprocPerNode = 1024;
  if (f.nproc_per_node > kMaxNprocPerNode) {
    return Status::InvalidArgument(fmt::format(
        "--nproc-per-node {} is more than {} processes on one node; give a smaller count",
        f.nproc_per_node, kMaxNprocPerNode));
  }
  // Durations become integer milliseconds added to clock readings: a bound keeps both finite.
  constexpr double kMaxSeconds = 365.0 * 24 * 3600;
  auto positive = [&](double v, const char* flag) -> Status {
    if (!(v > 0) || !std::isfinite(v)) {
      return Status::InvalidArgument(fmt::format("{} {} must be a positive number of seconds",
                                                 flag, v));
    }
    if (v > kMaxSeconds) {
      return Status::InvalidArgument(fmt::format(
          "{} {} is more than a year; give at most {} seconds", flag, v, kMaxSeconds));
    }
    return Status::OK();
  };
  EFDL_RETURN_IF_ERROR(positive(f.ttl_s, "--ttl"));
  if (f.ttl_s < 1) {
    return Status::InvalidArgument(fmt::format(
        "--ttl {} is below etcd's lease granularity; give at least 1 second", f.ttl_s));
  }
  EFDL_RETURN_IF_ERROR(positive(f.join_timeout_s, "--join-timeout"));
  EFDL_RETURN_IF_ERROR(positive(f.stop_grace_s, "--stop-grace"));
  if (!(f.last_call_s >= 0) || !std::isfinite(f.last_call_s) || f.last_call_s > kMaxSeconds) {
    return Status::InvalidArgument(
        fmt::format("--last-call {} must be zero or a positive number of seconds, at most a year",
                    f.last_call_s));
  }
  if (f.max_restarts < 0) {
    return Status::InvalidArgument(
        fmt::format("--max-restarts {} is negative; give 0 or more", f.max_restarts));
  }
  if (f.exclude_after < 0) {
    return Status::InvalidArgument(fmt::format(
        "--exclude-after {} is negative; give the number of this node's own worker failures "
        "within --exclude-window that exclude it for a cool-down, or 0 to never exclude it",
        f.exclude_after));
  }
  EFDL_RETURN_IF_ERROR(positive(f.exclude_window_s, "--exclude-window"));
  EFDL_RETURN_IF_ERROR(positive(f.exclude_cooldown_s, "--exclude-cooldown"));

  std::error_code ec;
  auto absolute = [&](const std::string& p) {
    return p.empty() ? p : std::filesystem::absolute(p, ec).lexically_normal().string();
  };

  agent::AgentOptions& a = plan.agent;
  a.job_id = job;
  a.node_id = node_id;
  a.shared_etcd = !plan.embedded_etcd;
  a.command = f.command;
  a.nproc = f.nproc_per_node > 0 ? f.nproc_per_node : DefaultNprocPerNode();
  if (f.world_size > 0 && a.nproc > f.world_size) {
    return Status::InvalidArgument(fmt::format(
        "this node's {} processes (--nproc-per-node{}) exceed --world-size {}; give at most "
        "--nproc-per-node {}", a.nproc, f.nproc_per_node > 0 ? "" : ", default: visible GPUs",
        f.world_size, f.world_size));
  }
  if (f.world_size > 0 && plan.embedded_etcd && a.nproc != f.world_size) {
    return Status::InvalidArgument(fmt::format(
        "--world-size {} with {} process(es) on this node needs more nodes and an etcd they "
        "share: pass --etcd HOST:PORT (or set EFDL_ETCD_ENDPOINTS)", f.world_size, a.nproc));
  }
  a.launcher = f.launcher;
  a.world_size = f.world_size;
  a.min_nodes = nodes.min;
  a.max_nodes = nodes.max;
  a.max_restarts = f.max_restarts;
  a.exclude_after = f.exclude_after;
  a.exclude_window = Millis(f.exclude_window_s);
  a.exclude_cooldown = Millis(f.exclude_cooldown_s);
  a.stop_grace = Millis(f.stop_grace_s);
  if (f.hang_timeout == "auto" || f.hang_timeout.empty()) {
    a.hang_timeout_s = -1;
  } else {
    char* end = nullptr;
    const double t = std::strtod(f.hang_timeout.c_str(), &end);
    if (end == f.hang_timeout.c_str() || *end != '\0' || !(t >= 0) || !std::isfinite(t) ||
        t > kMaxSeconds) {
      return Status::InvalidArgument(fmt::format(
          "--hang-timeout {} is not a number of seconds: give seconds without progress before "
          "a rank is declared hung, 0 to turn hang detection off, or auto (the default)",
          f.hang_timeout));
    }
    a.hang_timeout_s = t;
  }
  // Stragglers (issue #32 part 3, src/health/straggler_rules.h).
  if (!(f.straggler_factor == 0 || f.straggler_factor >= health::kMinFactor) ||
      !std::isfinite(f.straggler_factor)) {
    return Status::InvalidArgument(fmt::format(
        "--straggler-factor {} must be 0 (straggler detection off) or at least {}: a node is "
        "named a straggler when its slowest rank computes this many times the median of the "
        "other nodes' ranks per step", f.straggler_factor, health::kMinFactor));
  }
  const double min_window = 1e-3 * static_cast<double>(
      (health::kMinPeriod * health::kWindowsToName).count());
  if (!(f.straggler_window_s >= min_window) || !std::isfinite(f.straggler_window_s) ||
      f.straggler_window_s > kMaxSeconds) {
    return Status::InvalidArgument(fmt::format(
        "--straggler-window {} must be at least {:g} seconds: a node is named a straggler once "
        "it was slow for this long ({} summaries)", f.straggler_window_s, min_window,
        health::kWindowsToName));
  }
  a.stragglers.factor = f.straggler_factor;
  a.stragglers.window = Millis(f.straggler_window_s);
  a.stragglers.evict = f.evict_stragglers;
  if (f.evict_stragglers && (f.straggler_factor == 0 || !agent::HangDetectionOn(a) || f.launcher)) {
    return Status::InvalidArgument(
        "--evict-stragglers needs straggler detection, which reads the workers' progress "
        "board: drop --straggler-factor 0, --hang-timeout 0 and --launcher, or drop "
        "--evict-stragglers");
  }
  auto metrics = metrics::ParseListen(f.metrics_port);
  if (!metrics.ok()) return metrics.status();
  plan.metrics = *metrics;
  const bool prestart_fits = !f.launcher && agent::ParsePythonCommand(f.command).has_value();
  if (f.prestart == PrestartMode::kOn && !prestart_fits) {
    return Status::InvalidArgument(
        "--prestart needs a worker command of the form 'python3 [-u] SCRIPT ...' or 'python3 -m "
        "MODULE ...' (and no --launcher); drop --prestart (or unset EFDL_PRESTART)");
  }
  // Auto: on wherever a spare can stand in for the worker; other commands are spawned.
  a.prestart = f.prestart != PrestartMode::kOff && prestart_fits;
  a.prestart_requested = f.prestart == PrestartMode::kOn;
  a.zygote = !f.no_zygote;
  a.learn_imports = !f.no_learn_imports;
  a.log_dir = absolute(f.log_dir);
  a.snapshot_dir = absolute(f.snapshot_dir);

  if (!f.resume_args.empty()) {
    EFDL_ASSIGN_OR_RETURN(a.resume_args, ParseResumeArgs(f.resume_args));
  }
  if (f.horovod) {
    // The interpreter whose `import horovod` the stand-in answers: the command's (python...),
    // else (a shell script, --launcher) the python3 on PATH.
    const bool python = !f.command.empty() && std::filesystem::path(f.command[0])
                                                  .filename().string().starts_with("python");
    EFDL_ASSIGN_OR_RETURN(a.horovod_shim_dir,
                          FindHorovodShim({python ? f.command[0] : "python3"},
                                          std::chrono::seconds(30)));
  }

  // Where the peers reach this node, and the interface the workers' gloo/NCCL use for it
  // (docs/operations.md, "Networking").
  EFDL_ASSIGN_OR_RETURN(NetworkInputs net,
                        SystemNetworkInputs(f.etcd_endpoints, f.advertise_addr, f.iface));
  EFDL_ASSIGN_OR_RETURN(NetworkChoice choice, ChooseNetwork(net));
  a.advertise_addr = choice.address;
  a.gloo_iface = choice.iface;
  plan.network = std::move(choice);

  // The rendezvous runs under the agent's identity: one JobSpec, copied whole.
  rdzv::RendezvousOptions& r = plan.rendezvous;
  static_cast<JobSpec&>(r) = static_cast<const JobSpec&>(a);
  r.ttl = Millis(f.ttl_s);
  r.last_call = Millis(f.last_call_s);
  r.join_timeout = Millis(f.join_timeout_s);
  // A python program's script (or module): the nodes of one job must agree on it.
  if (!f.command.empty() &&
      std::filesystem::path(f.command[0]).filename().string().starts_with("python")) {
    r.program = std::filesystem::path(JobProgram(f.command)).filename().string();
  }
  return plan;
}

}  // namespace efdl::cli
