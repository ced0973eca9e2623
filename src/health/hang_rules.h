// Hang detection's rules as pure functions (issue #32): no clock reads, no processes. The
// HangMonitor (hang_monitor.h) feeds them what it sampled of the progress board and /proc.
//
// THE RULE (docs/operations.md, "Hangs"):
//   - a rank is judged only once this node's program reported progress at least once (through
//     State.commit() or efdl.progress()): a program that never reports is never declared hung;
//   - running timeout: --hang-timeout T when given; by default (auto) the larger of 180 s and 10 x
//     the slowest of the last 32 intervals between progress reports of this node's ranks;
//   - before a rank's first progress in a round (new workers importing and restoring, or
//     in-process workers agreeing on the state): the larger of 600 s and 3 x the running
//     timeout under auto, of 300 s and the running timeout under an explicit T;
//   - a rank that announced a pause (efdl.progress(expect_pause=S), efdl.pause_expected(S)) is
//     not judged until the announced end, and the timeout counts from there.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>

namespace efdl::health {

struct HangConfig {
  // 0: detection off; > 0: the running timeout in seconds; < 0: auto (the rule above).
  double timeout_s = -1;
  bool enabled() const { return timeout_s != 0; }
};

inline constexpr double kAutoFloorSeconds = 180;
inline constexpr double kAutoFactor = 10;
inline constexpr double kAutoFirstFloorSeconds = 600;
inline constexpr double kAutoFirstFactor = 3;
inline constexpr double kExplicitFirstFloorSeconds = 300;
inline constexpr size_t kIntervalWindow = 32;

// The running timeout for a node whose slowest recent interval is `slowest_interval_s` (0:
// none measured yet).
double RunningTimeout(const HangConfig& cfg, double slowest_interval_s);
// The grace before a rank's first progress in a round.
double FirstProgressGrace(const HangConfig& cfg, double slowest_interval_s);

// What the monitor tracked of one local rank since it was armed.
struct RankTrack {
  bool progressed = false;          // at least one report since armed (this round)
  int64_t since_ns = 0;             // the last report, or the arming when none yet
  int64_t pause_until_ns = 0;       // an announced pause ends then (0: none)
};

struct Judgement {
  bool hung = false;
  double silent_s = 0;   // seconds without progress (from the later of since and a pause's end)
  double limit_s = 0;    // the timeout that applied
};
// `program_reports`: this node's program has reported progress at least once (any rank, any
// round); false: nothing is judged.
Judgement Judge(const HangConfig& cfg, const RankTrack& rank, bool program_reports,
                double slowest_interval_s, int64_t now_ns);

// The slowest of a window of intervals (0 when empty).
double Slowest(const std::deque<double>& intervals);

// A process' state letter from /proc/<pid>/stat ("R", "S", "D", "T", "t", "Z"...), as text.
std::string DescribeProcessState(char state);

// Whether a faulthandler dump of a worker shows it waiting in a collective: a frame of
// torch.distributed, DDP, autograd's backward (DDP's all-reduce runs from its hooks) or EFDL's
// own collectives (the state agreement, the Horovod layer). A rank that hangs elsewhere (its own
// code, a data loader, a sleep) while its peers wait in collectives is the hang's cause.
bool StackInCollective(std::string_view dump);

}  // namespace efdl::health
