// `efdl etcd`: runs etcd in the foreground, prints the endpoint, stops cleanly on SIGTERM.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "common/subprocess.h"
#include "efdl/etcd.h"

namespace efdl {
namespace {

using namespace std::chrono_literals;

// Reads the child's stdout until `needle` appears or `timeout` passes.
std::string ReadUntil(int fd, const std::string& needle, std::chrono::milliseconds timeout) {
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (out.find(needle) == std::string::npos) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[1024];
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string LineValue(const std::string& out, const std::string& prefix) {
  size_t at = out.find(prefix);
  if (at == std::string::npos) return {};
  size_t end = out.find('\n', at);
  return out.substr(at + prefix.size(), end - at - prefix.size());
}

TEST(EfdlEtcdCommand, PrintsEndpointServesClientsAndStopsCleanlyOnSigterm) {
  SpawnOptions spawn;
  spawn.argv = {EFDL_BIN, "etcd", "--port", "0"};
  spawn.stdout_mode = SpawnOptions::Stdio::kPipe;
  auto child = Subprocess::Spawn(spawn);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  const std::string out = ReadUntil(child->stdout_fd(), "Ctrl-C", 30s);
  const std::string endpoint = LineValue(out, "EFDL_ETCD_ENDPOINTS=");
  ASSERT_FALSE(endpoint.empty()) << out;
  const std::string data_line = LineValue(out, "(data: ");
  const std::string data_dir = data_line.substr(0, data_line.find(','));
  ASSERT_TRUE(std::filesystem::is_directory(data_dir)) << out;

  etcd::ClientOptions options;
  options.endpoints = {endpoint};
  auto client = etcd::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  ASSERT_TRUE((*client)->Put("/cli", "up").ok());

  // A second one on the same port is refused with a clear message and exit code 2.
  const std::string port = endpoint.substr(endpoint.rfind(':') + 1);
  SpawnOptions again = spawn;
  again.argv = {EFDL_BIN, "etcd", "--port", port};
  again.stdout_mode = SpawnOptions::Stdio::kNull;
  again.stderr_mode = SpawnOptions::Stdio::kPipe;
  auto second = Subprocess::Spawn(again);
  ASSERT_TRUE(second.ok());
  const std::string err = ReadUntil(second->stderr_fd(), "\n", 20s);
  const int second_status = second->Wait();
  EXPECT_TRUE(WIFEXITED(second_status) && WEXITSTATUS(second_status) == 2) << err;
  EXPECT_NE(err.find("in use"), std::string::npos) << err;

  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  auto status = child->WaitFor(15s);
  ASSERT_TRUE(status.has_value()) << "efdl etcd did not stop on SIGTERM";
  EXPECT_TRUE(WaitStatusSuccess(*status)) << DescribeWaitStatus(*status);
  EXPECT_FALSE(std::filesystem::exists(data_dir)) << "its temporary data directory is removed";
}

}  // namespace
}  // namespace efdl
