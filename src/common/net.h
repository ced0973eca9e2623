// Small socket and filesystem helpers shared by the agent, the embedded etcd and tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "efdl/status.h"

namespace efdl {

// A TCP port on `host` that was free a moment ago (bind to port 0, read it back, close).
Result<uint16_t> PickFreePort(const std::string& host = "127.0.0.1");
// True when something accepts TCP connections on host:port within timeout_ms.
bool TcpConnectable(const std::string& host, uint16_t port, int timeout_ms);
// This machine's host name.
std::string HostName();
// The name of the network interface that holds `host`'s address (a numeric IPv4/IPv6 address or
// a name resolved here), e.g. "lo" for 127.0.0.1; NotFound when no local interface has it (an
// address behind NAT, or another machine's). Horovod's gloo needs it as HOROVOD_GLOO_IFACE.
Result<std::string> InterfaceOfAddress(const std::string& host);

// The numeric addresses ("10.0.0.2", "fe80::1") of a host name or address literal, as a server
// sees its clients' peer addresses; NotFound when the name does not resolve.
Result<std::vector<std::string>> NumericAddresses(const std::string& host);

// A directory made with mkdtemp under $TMPDIR (or /tmp), removed with everything in it when the
// object is destroyed (unless Release()d).
class TempDir {
 public:
  static Result<TempDir> Create(const std::string& prefix = "efdl");
  TempDir() = default;
  TempDir(TempDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  TempDir& operator=(TempDir&& other) noexcept;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string Release() { return std::exchange(path_, {}); }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

}  // namespace efdl
