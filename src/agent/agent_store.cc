#include "agent/agent_store.h"

#include <charconv>
#include <vector>

#include <fmt/format.h>

#include "agent/spare_pool.h"
#include "common/log.h"

namespace efdl::agent {

Result<std::unique_ptr<AgentStore>> AgentStore::Start(
    SparePool& pool, const std::map<std::string, std::string>& env) {
  auto proc = pool.ActivateProgram({"-m", "efdl._agent_store"}, env);
  if (!proc) return Status::Unavailable("no pre-started worker is ready to run it");
  return std::make_unique<AgentStore>(std::move(*proc));
}

Result<std::optional<uint16_t>> AgentStore::Poll() {
  for (const auto& line : stdout_lines_.Feed(ReadAvailable(proc_.stdout_fd(), 1 << 16))) {
    if (!port_ && line.starts_with(kAgentStorePortLine)) {
      const std::string_view digits = std::string_view(line).substr(kAgentStorePortLine.size());
      unsigned port = 0;
      auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
      if (ec == std::errc() && end == digits.data() + digits.size() && port > 0 &&
          port <= 65535) {
        port_ = static_cast<uint16_t>(port);
        continue;
      }
    }
    EFDL_LOG_INFO("agent store (pid {}): {}", proc_.pid(), line);
  }
  for (const auto& line : stderr_lines_.Feed(ReadAvailable(proc_.stderr_fd(), 1 << 16))) {
    EFDL_LOG_INFO("agent store (pid {}): {}", proc_.pid(), line);
    if (!line.empty()) last_stderr_line_ = line;
  }
  if (auto status = proc_.Poll()) {
    std::string rest = stderr_lines_.TakeRest();
    if (!rest.empty()) last_stderr_line_ = rest;
    return Status::Unavailable(fmt::format(
        "the agent store (pid {}) {}{}{}", proc_.pid(), DescribeWaitStatus(*status),
        last_stderr_line_.empty() ? "" : ": ", last_stderr_line_));
  }
  return port_;
}

}  // namespace efdl::agent
