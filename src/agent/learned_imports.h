// LearnedImports: the program's imports a SparePool learns from its workers' reports (zygote.h,
// "Learning the program's imports"; issue #31 step 1), in the order first reported, and the
// zygote's side of them: how many the current zygote was sent, whether its answer to the last
// request is awaited, and whether learning was turned off (the zygote could not import them).
//
// The pool starts, sends to and reads the zygote; this only keeps the list. Single-threaded;
// times are passed in.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace efdl::agent {

// The module names in the import reports (`imports-*.json`, zygote.h) in `dir`, which are
// removed once read; unreadable reports are removed too. Names appear in the order read.
std::vector<std::string> TakeImportReports(const std::string& dir);

class LearnedImports {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds kScanInterval{1};

  // `dir`: where the workers write their reports; empty: nothing is learned.
  explicit LearnedImports(std::string dir) : dir_(std::move(dir)) {}

  // Takes the reports written since the last scan into the list, at most once per
  // kScanInterval (nothing once turned off).
  void Read(Clock::time_point now);
  // A new zygote: everything learned goes to it once it is ready; no request is awaited.
  void NewZygote() {
    sent_ = 0;
    sent_at_.reset();
  }
  // The names the current zygote was not sent yet (none once turned off).
  std::vector<std::string> Unsent() const;
  // They were sent at `now`: the zygote's answer is awaited.
  void Sent(Clock::time_point now) {
    sent_ = names_.size();
    sent_at_ = now;
  }
  bool awaiting() const { return sent_at_.has_value(); }
  // The zygote answered (or is gone) at `now`: the seconds it took; nothing is awaited then.
  double Answered(Clock::time_point now);
  // The zygote could not import them: no more learning.
  void TurnOff() { off_ = true; }
  bool off() const { return off_; }
  // Every name learned so far.
  const std::vector<std::string>& names() const { return names_; }

 private:
  const std::string dir_;
  std::vector<std::string> names_;
  std::set<std::string> seen_;
  size_t sent_ = 0;                          // the current zygote was sent names_[0, sent_)
  std::optional<Clock::time_point> sent_at_;  // the request awaiting an answer
  bool off_ = false;
  Clock::time_point next_scan_{};
};

}  // namespace efdl::agent
