// `efdl run`'s flags (src/cli/run_command.cc) turned into the options of the agent and its rendezvous, with every check
// done before anything starts (one clear line per mistake).
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "agent/agent.h"
#include "common/job_spec.h"
#include "common/net.h"
#include "efdl/status.h"
#include "metrics/agent_metrics.h"
#include "rendezvous/rendezvous.h"

namespace efdl::cli {

// --prestart / --no-prestart / neither (EFDL_PRESTART=1 / 0 / unset).
enum class PrestartMode {
  kAuto,  // pre-started workers for a command ParsePythonCommand accepts, without --launcher
  kOn,    // the same, but any other command is an error
  kOff,   // always spawn workers
};

// The flags as the user gave them (after environment fallbacks). One field per `efdl run` flag
// (docs/agent.md's table), flat on purpose: a plain record that PlanRun turns into the
// structured options below.
struct RunFlags {
  std::vector<std::string> etcd_endpoints;   // parsed; empty: a private embedded etcd
  std::string job_id;                        // empty: "default" without --etcd, else an error
  std::string nnodes;                        // empty: 1:1, or 1:N with world_size N
  int world_size = 0;                        // >0: fragmented job of exactly N processes
  bool launcher = false;                     // one process per node (an inner launcher)
  int nproc_per_node = 0;                    // 0: visible GPUs, else 1
  std::string node_id;                       // empty: host name plus a unique suffix
  std::string advertise_addr;                // empty: chosen by ChooseNetwork (common/net.h)
  std::string iface;                         // empty: the interface of the advertise address
  double ttl_s = 10;
  double last_call_s = 3;
  double join_timeout_s = 600;
  int max_restarts = 3;
  int exclude_after = 3;                     // --exclude-after K (0: never excluded)
  double exclude_window_s = 600;             // --exclude-window
  double exclude_cooldown_s = 300;           // --exclude-cooldown
  double stop_grace_s = 10;
  std::string hang_timeout = "auto";         // --hang-timeout: "auto", 0 (off) or seconds
  double straggler_factor = 2.0;             // --straggler-factor (0: off)
  double straggler_window_s = 30;            // --straggler-window
  bool evict_stragglers = false;             // --evict-stragglers
  std::string metrics_port = "auto";         // --metrics-port: "auto", "off" or a port (0: any)
  std::string log_dir;
  std::string snapshot_dir = "efdl-snapshots";
  PrestartMode prestart = PrestartMode::kAuto;  // pre-started python workers (SparePool)
  bool no_zygote = false;                    // --no-zygote: spares are not forked from a zygote
  bool no_learn_imports = false;             // --no-learn-imports: the zygote imports only
                                             // EFDL_PRELOAD_MODULES
  std::string resume_args;                   // --resume-args: split at spaces, see AgentOptions
  bool horovod = false;                      // --horovod: `import horovod` is EFDL's layer
  std::vector<std::string> command;
};

struct RunPlan {
  agent::AgentOptions agent;
  rdzv::RendezvousOptions rendezvous;
  bool embedded_etcd = false;
  NetworkChoice network;                     // the advertise address and interface, and why
  metrics::Listen metrics;                   // where the agent's Prometheus endpoint listens
};

struct NodeRange {
  int min = 1;
  int max = 1;
};

// "N" or "MIN:MAX", 1 <= MIN <= MAX.
Result<NodeRange> ParseNodeRange(std::string_view spec);
// Visible GPUs: CUDA_VISIBLE_DEVICES when set, else /dev/nvidia<N> device files, else 1.
int DefaultNprocPerNode();
// "<host>-<pid>-<4 random hex>": unique among agents on one machine and across restarts.
std::string DefaultNodeId();
// The program of a training command whose job id is derived (no --job, no --etcd): the SCRIPT
// of `python3 [OPTIONS] SCRIPT`, the MODULE of `-m MODULE`, "" for `-c`, else the executable.
std::string JobProgram(const std::vector<std::string>& command);
// --resume-args' value as arguments: split at spaces and tabs; quotes and backslashes are
// refused (nothing interprets them), as is an empty value given explicitly.
Result<std::vector<std::string>> ParseResumeArgs(std::string_view value);
// --horovod: asks `interpreter` (with this process's environment) where it imports efdl from and
// whether it finds a `horovod` package; the directory holding EFDL's stand-in `horovod`
// (<efdl>/_horovod_shim), or one error line when a real Horovod is importable there, efdl is
// not, or the interpreter does not answer within `timeout`.
Result<std::string> FindHorovodShim(const std::vector<std::string>& interpreter,
                                    std::chrono::milliseconds timeout);
// Validates everything and resolves defaults; looks the command up in PATH; with --horovod,
// runs the command's interpreter once (FindHorovodShim).
Result<RunPlan> PlanRun(const RunFlags& flags);

}  // namespace efdl::cli
