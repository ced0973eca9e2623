#include "common/log.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <string>

#include "common/env_names.h"

namespace efdl {

namespace {
LogLevel ThresholdFromEnv() {
  const char* v = std::getenv(envvar::kLogLevel);
  if (v == nullptr) return LogLevel::kInfo;
  std::string_view s(v);
  if (s == "debug") return LogLevel::kDebug;
  if (s == "warn" || s == "warning") return LogLevel::kWarn;
  if (s == "error") return LogLevel::kError;
  return LogLevel::kInfo;
}
char LevelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return 'D';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kWarn: return 'W';
    case LogLevel::kError: return 'E';
  }
  return '?';
}
}  // namespace

bool LogEnabled(LogLevel level) {
  // Read once: the environment does not change under a running agent.
  static const LogLevel threshold = ThresholdFromEnv();
  return level >= threshold;
}

std::string WallClockTimestamp() {
  using namespace std::chrono;
  auto now = system_clock::now();
  std::time_t secs = system_clock::to_time_t(now);
  auto ms = duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

void LogLine(LogLevel level, std::string_view message) {
  std::string line = fmt::format("{} {} efdl: {}\n", WallClockTimestamp(), LevelLetter(level), message);
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace efdl
