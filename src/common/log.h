// Line-oriented logging to stderr: "2026-12-02T12:00:00.123Z I efdl: message".
//
// No global logger object: the threshold comes from EFDL_LOG_LEVEL (debug|info|warn|error) and
// each line is written with a single write(2), so lines from threads and processes never mix.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace efdl {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

bool LogEnabled(LogLevel level);
void LogLine(LogLevel level, std::string_view message);
// ISO-8601 UTC wall-clock time with milliseconds, as used in log lines.
std::string WallClockTimestamp();

template <class... Args>
void Log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (!LogEnabled(level)) return;
  LogLine(level, fmt::format(format, std::forward<Args>(args)...));
}

#define EFDL_LOG_DEBUG(...) ::efdl::Log(::efdl::LogLevel::kDebug, __VA_ARGS__)
#define EFDL_LOG_INFO(...) ::efdl::Log(::efdl::LogLevel::kInfo, __VA_ARGS__)
#define EFDL_LOG_WARN(...) ::efdl::Log(::efdl::LogLevel::kWarn, __VA_ARGS__)
#define EFDL_LOG_ERROR(...) ::efdl::Log(::efdl::LogLevel::kError, __VA_ARGS__)

}  // namespace efdl
