#include "health/hang_monitor.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <fstream>
#include <sstream>
#include <thread>

namespace efdl::health {
namespace {

char ProcessState(pid_t pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(f, line)) return '?';
  // pid (comm) S ...: comm may hold spaces and parentheses; the state follows the last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return '?';
  return line[close + 2];
}

std::string StackPath(const std::string& dir, pid_t pid) {
  return fmt::format("{}/stack-{}.txt", dir, pid);
}

off_t FileSize(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

std::string ReadFrom(const std::string& path, off_t offset) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  f.seekg(offset);
  std::ostringstream out;
  out << f.rdbuf();
  return out.str();
}

}  // namespace

Result<std::unique_ptr<HangMonitor>> HangMonitor::Create(const std::string& dir, int slots,
                                                         HangConfig config) {
  auto board = ProgressBoard::Create(dir + "/" + kBoardFile, slots);
  if (!board.ok()) return board.status();
  return std::unique_ptr<HangMonitor>(new HangMonitor(dir, std::move(board).value(), config));
}

void HangMonitor::Arm(const std::vector<pid_t>& pids, bool fresh) {
  const int64_t now = MonotonicNanos();
  ranks_.assign(pids.size(), Rank{});
  for (size_t i = 0; i < pids.size(); ++i) {
    if (fresh) board_->Reset(static_cast<int>(i));
    const SlotView v = board_->Read(static_cast<int>(i));
    Rank& r = ranks_[i];
    r.pid = pids[i];
    r.beats = v.beats;
    r.last_ns = v.last_ns;
    r.step = v.step;
    r.samples = v.samples;
    r.track.since_ns = now;
  }
  armed_ns_ = now;
  armed_ = !pids.empty();
  reported_ = false;
}

void HangMonitor::Sample() {
  for (size_t i = 0; i < ranks_.size(); ++i) {
    Rank& r = ranks_[i];
    const SlotView v = board_->Read(static_cast<int>(i));
    r.track.pause_until_ns = v.pause_until_ns;
    if (v.beats > r.beats && v.last_ns > 0) {
      if (r.track.progressed && r.last_ns > 0 && v.last_ns > r.last_ns) {
        const double per = static_cast<double>(v.last_ns - r.last_ns) / 1e9 /
                           static_cast<double>(v.beats - r.beats);
        intervals_.push_back(per);
        r.interval_s = per;
        while (intervals_.size() > kIntervalWindow) intervals_.pop_front();
      }
      if (v.samples >= 0 && r.samples >= 0 && v.samples >= r.samples) {
        r.step_samples = static_cast<double>(v.samples - r.samples) /
                         static_cast<double>(v.beats - r.beats);
      }
      r.samples = v.samples;
      r.beats = v.beats;
      r.last_ns = v.last_ns;
      r.step = v.step;
      r.track.progressed = true;
      r.track.since_ns = v.last_ns;
      program_reports_ = true;
    }
  }
}

int64_t HangMonitor::Uncommitted() const {
  int64_t most = -1;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    most = std::max(most, board_->Read(static_cast<int>(i)).uncommitted);
  }
  return most;
}

std::vector<HangMonitor::RankSample> HangMonitor::Progress() {
  std::vector<RankSample> out;
  if (!armed_) return out;
  Sample();
  const int64_t now = MonotonicNanos();
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const Rank& r = ranks_[i];
    // A restore said before this arming was the previous round's (in-process continuation).
    const SlotView v = board_->Read(static_cast<int>(i));
    const int64_t restored = v.restored_ns;
    out.push_back({static_cast<int>(i), r.track.progressed, r.step, r.interval_s,
                   static_cast<double>(now - r.track.since_ns) / 1e9, r.step_samples,
                   restored >= armed_ns_ ? restored : 0, v.compute_ns, v.compute_steps});
  }
  return out;
}

bool HangMonitor::Stalled(double fraction) {
  if (!armed_ || ranks_.empty() || !config_.enabled()) return false;
  Sample();
  const int64_t now = MonotonicNanos();
  const double slowest = Slowest(intervals_);
  for (const Rank& r : ranks_) {
    const Judgement j = Judge(config_, r.track, program_reports_, slowest, now);
    if (j.limit_s <= 0 || j.silent_s < fraction * j.limit_s) return false;
  }
  return true;
}

std::vector<HungRank> HangMonitor::Check() {
  std::vector<HungRank> hung;
  if (!armed_ || reported_ || !config_.enabled()) return hung;
  Sample();
  const int64_t now = MonotonicNanos();
  const double slowest = Slowest(intervals_);
  for (size_t i = 0; i < ranks_.size(); ++i) {
    const Judgement j = Judge(config_, ranks_[i].track, program_reports_, slowest, now);
    if (j.hung) hung.push_back({static_cast<int>(i), j.silent_s, j.limit_s, ranks_[i].step});
  }
  if (!hung.empty()) reported_ = true;
  return hung;
}

double HangMonitor::running_timeout_s() const {
  return RunningTimeout(config_, Slowest(intervals_));
}

std::vector<StackReport> HangMonitor::DumpStacks(std::chrono::milliseconds wait) {
  std::vector<StackReport> out;
  std::vector<off_t> offsets;
  for (size_t i = 0; i < ranks_.size(); ++i) {
    StackReport s;
    s.local_rank = static_cast<int>(i);
    s.pid = ranks_[i].pid;
    s.state = ProcessState(s.pid);
    const std::string path = StackPath(dir_, s.pid);
    offsets.push_back(std::max<off_t>(0, FileSize(path)));
    // A stopped process would write its stack only once continued; one in uninterruptible
    // sleep only once woken: neither is waited for.
    if (s.state != 'T' && s.state != 't' && s.state != 'D' && s.state != 'Z' && s.state != '?') {
      ::kill(s.pid, kStackSignal);
    }
    out.push_back(std::move(s));
  }
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (size_t i = 0; i < out.size(); ++i) {
    StackReport& s = out[i];
    if (s.state == 'T' || s.state == 't' || s.state == 'D' || s.state == 'Z' || s.state == '?') {
      continue;
    }
    const std::string path = StackPath(dir_, s.pid);
    // faulthandler writes the whole dump at once; wait for it to appear and stop growing.
    off_t seen = -1;
    while (std::chrono::steady_clock::now() < deadline) {
      const off_t size = FileSize(path);
      if (size > offsets[i] && size == seen) break;
      seen = size;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    s.stack = ReadFrom(path, offsets[i]);
  }
  for (auto& s : out) {
    if (s.state == 'T' || s.state == 't' || s.state == 'D') {
      s.culprit = true;
      s.why = DescribeProcessState(s.state);
    } else if (s.state == 'Z' || s.state == '?') {
      s.why = "exited";
    } else if (s.stack.empty()) {
      s.why = "wrote no stack (its program does not arm efdl's stack dump)";
    } else {
      s.in_collective = StackInCollective(s.stack);
      s.culprit = !s.in_collective;
      s.why = s.in_collective ? "waiting in a collective" : "not in a collective";
    }
  }
  return out;
}

}  // namespace efdl::health
