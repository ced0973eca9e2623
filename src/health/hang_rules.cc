#include "health/hang_rules.h"

#include <algorithm>
#include <array>

namespace efdl::health {

double RunningTimeout(const HangConfig& cfg, double slowest_interval_s) {
  if (cfg.timeout_s > 0) return cfg.timeout_s;
  return std::max(kAutoFloorSeconds, kAutoFactor * slowest_interval_s);
}

double FirstProgressGrace(const HangConfig& cfg, double slowest_interval_s) {
  const double running = RunningTimeout(cfg, slowest_interval_s);
  if (cfg.timeout_s > 0) return std::max(kExplicitFirstFloorSeconds, running);
  return std::max(kAutoFirstFloorSeconds, kAutoFirstFactor * running);
}

Judgement Judge(const HangConfig& cfg, const RankTrack& rank, bool program_reports,
                double slowest_interval_s, int64_t now_ns) {
  Judgement j;
  if (!cfg.enabled() || !program_reports) return j;
  j.limit_s = rank.progressed ? RunningTimeout(cfg, slowest_interval_s)
                              : FirstProgressGrace(cfg, slowest_interval_s);
  const int64_t from = std::max(rank.since_ns, rank.pause_until_ns);
  if (now_ns < rank.pause_until_ns) return j;
  j.silent_s = static_cast<double>(now_ns - from) / 1e9;
  j.hung = j.silent_s >= j.limit_s;
  return j;
}

double Slowest(const std::deque<double>& intervals) {
  double m = 0;
  for (double x : intervals) m = std::max(m, x);
  return m;
}

std::string DescribeProcessState(char state) {
  switch (state) {
    case 'T':
      return "stopped (SIGSTOP, or a job control stop)";
    case 't':
      return "stopped by a debugger";
    case 'D':
      return "in uninterruptible sleep (waiting for a device or a file system)";
    case 'Z':
      return "exited (a zombie)";
    case 'R':
      return "running";
    case 'S':
      return "sleeping";
    default:
      return std::string("in state ") + state;
  }
}

bool StackInCollective(std::string_view dump) {
  static constexpr std::array<std::string_view, 6> kMarks = {
      "torch/distributed/", "torch/nn/parallel/distributed.py", "torch/autograd/",
      "efdl/_agreement.py", "efdl/backend/horovod/torch/_layer.py", "horovod/torch/mpi_ops.py"};
  for (auto mark : kMarks) {
    if (dump.find(mark) != std::string_view::npos) return true;
  }
  return false;
}

}  // namespace efdl::health
