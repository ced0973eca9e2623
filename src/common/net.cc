#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

namespace efdl {

namespace {
Result<sockaddr_in> Resolve(const std::string& host, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::InvalidArgument(fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc)));
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return addr;
}

// The numeric text ("10.0.0.2", "fe80::1") of an IPv4 or IPv6 socket address; nullopt for any
// other family. One canonical form, so equal addresses have equal texts.
std::optional<std::string> AddressText(const sockaddr* sa) {
  const void* bytes = nullptr;
  if (sa->sa_family == AF_INET) {
    bytes = &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr;
  } else if (sa->sa_family == AF_INET6) {
    bytes = &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  } else {
    return std::nullopt;
  }
  char text[INET6_ADDRSTRLEN] = {};
  if (::inet_ntop(sa->sa_family, bytes, text, sizeof(text)) == nullptr) return std::nullopt;
  return std::string(text);
}
}  // namespace

Result<std::vector<std::string>> NumericAddresses(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status::NotFound(fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* p = res; p != nullptr; p = p->ai_next) {
    auto text = AddressText(p->ai_addr);
    if (text && std::find(out.begin(), out.end(), *text) == out.end()) out.push_back(*text);
  }
  ::freeaddrinfo(res);
  return out;
}

Result<std::string> InterfaceOfAddress(const std::string& host) {
  EFDL_ASSIGN_OR_RETURN(std::vector<std::string> wanted, NumericAddresses(host));
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) {
    return Status::IOError(fmt::format("cannot list network interfaces: {}", std::strerror(errno)));
  }
  std::string found;
  for (ifaddrs* i = ifs; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_name == nullptr) continue;
    auto text = AddressText(i->ifa_addr);
    if (text && std::find(wanted.begin(), wanted.end(), *text) != wanted.end()) {
      found = i->ifa_name;
    }
  }
  ::freeifaddrs(ifs);
  if (found.empty()) {
    return Status::NotFound(
        fmt::format("no network interface of this machine has the address of '{}'", host));
  }
  return found;
}

Result<uint16_t> PickFreePort(const std::string& host) {
  EFDL_ASSIGN_OR_RETURN(sockaddr_in addr, Resolve(host, 0));
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::Internal(fmt::format("socket: {}", std::strerror(errno)));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    int e = errno;
    ::close(fd);
    return Status::Unavailable(fmt::format("cannot bind a port on {}: {}", host, std::strerror(e)));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return static_cast<uint16_t>(ntohs(addr.sin_port));
}

bool TcpConnectable(const std::string& host, uint16_t port, int timeout_ms) {
  auto addr = Resolve(host, port);
  if (!addr.ok()) return false;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  bool ok = false;
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&*addr), sizeof(sockaddr_in));
  if (rc == 0) {
    ok = true;
  } else if (errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, timeout_ms) == 1) {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      ok = err == 0;
    }
  }
  ::close(fd);
  return ok;
}

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

Result<TempDir> TempDir::Create(const std::string& prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string templ = fmt::format("{}/{}-XXXXXX", base && *base ? base : "/tmp", prefix);
  if (::mkdtemp(templ.data()) == nullptr) {
    return Status::IOError(fmt::format("cannot create a temporary directory {}: {}", templ,
                                       std::strerror(errno)));
  }
  return TempDir(templ);
}

TempDir& TempDir::operator=(TempDir&& other) noexcept {
  if (this != &other) {
    this->~TempDir();
    path_ = std::exchange(other.path_, {});
  }
  return *this;
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
  path_.clear();
}

}  // namespace efdl
