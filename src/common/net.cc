#include "common/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
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
#include <fmt/ranges.h>

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

Result<std::vector<InterfaceAddress>> LocalInterfaceAddresses() {
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) {
    return Status::IOError(fmt::format("cannot list network interfaces: {}", std::strerror(errno)));
  }
  std::vector<InterfaceAddress> out;
  for (ifaddrs* i = ifs; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_name == nullptr) continue;
    auto text = AddressText(i->ifa_addr);
    if (!text) continue;
    InterfaceAddress a;
    a.name = i->ifa_name;
    a.address = *text;
    a.loopback = (i->ifa_flags & IFF_LOOPBACK) != 0;
    a.up = (i->ifa_flags & IFF_UP) != 0;
    if (i->ifa_netmask != nullptr) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(
          i->ifa_addr->sa_family == AF_INET
              ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(i->ifa_netmask)->sin_addr)
              : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(i->ifa_netmask)->sin6_addr));
      const size_t n = i->ifa_addr->sa_family == AF_INET ? 4 : 16;
      for (size_t b = 0; b < n; ++b) a.prefix_len += __builtin_popcount(bytes[b]);
    }
    out.push_back(std::move(a));
  }
  ::freeifaddrs(ifs);
  return out;
}

Result<std::string> SourceAddressFor(const std::string& address, uint16_t port) {
  sockaddr_storage dst{};
  socklen_t dst_len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&dst);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&dst);
  const uint16_t p = htons(port != 0 ? port : 9);  // any port: nothing is sent
  if (::inet_pton(AF_INET, address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = p;
    dst_len = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = p;
    dst_len = sizeof(sockaddr_in6);
  } else {
    return Status::InvalidArgument(fmt::format("'{}' is not a numeric address", address));
  }
  int fd = ::socket(dst.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::Internal(fmt::format("socket: {}", std::strerror(errno)));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&dst), dst_len) != 0) {
    int e = errno;
    ::close(fd);
    return Status::Unavailable(fmt::format("no route to {}: {}", address, std::strerror(e)));
  }
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  int rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len);
  int e = errno;
  ::close(fd);
  if (rc != 0) return Status::Internal(fmt::format("getsockname: {}", std::strerror(e)));
  auto text = AddressText(reinterpret_cast<sockaddr*>(&local));
  if (!text) return Status::Internal("getsockname returned an address of another family");
  return *text;
}

namespace {

// Host and port of "host:port" / "[v6]:port" (as etcd::ParseEndpoints writes them).
std::pair<std::string, uint16_t> SplitEndpoint(const std::string& endpoint) {
  auto port_of = [](const std::string& text) {
    return static_cast<uint16_t>(std::strtoul(text.c_str(), nullptr, 10));
  };
  if (endpoint.starts_with("[")) {
    size_t close = endpoint.find(']');
    if (close == std::string::npos) return {endpoint, 0};
    uint16_t port = close + 1 < endpoint.size() && endpoint[close + 1] == ':'
                        ? port_of(endpoint.substr(close + 2))
                        : 0;
    return {endpoint.substr(1, close - 1), port};
  }
  size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || endpoint.find(':') != colon) return {endpoint, 0};
  return {endpoint.substr(0, colon), port_of(endpoint.substr(colon + 1))};
}

bool IsIpv6(const std::string& address) { return address.find(':') != std::string::npos; }

// The address's bytes (4 or 16); empty when it is not a numeric address.
std::vector<unsigned char> AddressBytes(const std::string& address) {
  unsigned char buf[16];
  if (::inet_pton(AF_INET, address.c_str(), buf) == 1) return {buf, buf + 4};
  if (::inet_pton(AF_INET6, address.c_str(), buf) == 1) return {buf, buf + 16};
  return {};
}

bool IsLoopbackAddress(const std::string& address) {
  auto b = AddressBytes(address);
  if (b.size() == 4) return b[0] == 127;
  if (b.size() == 16) {
    static const unsigned char kLoop6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    if (std::equal(b.begin(), b.end(), kLoop6)) return true;
    // ::ffff:127.x.y.z
    bool mapped = std::all_of(b.begin(), b.begin() + 10, [](unsigned char c) { return c == 0; }) &&
                  b[10] == 0xff && b[11] == 0xff;
    return mapped && b[12] == 127;
  }
  return false;
}

bool IsLinkLocal6(const std::string& address) {
  auto b = AddressBytes(address);
  return b.size() == 16 && b[0] == 0xfe && (b[1] & 0xc0) == 0x80;
}

// Whether `ia` holds `address`: its own address, or (a loopback interface) any address of its
// network, as lo answers for all of 127.0.0.0/8.
bool Holds(const InterfaceAddress& ia, const std::string& address) {
  auto want = AddressBytes(address);
  auto have = AddressBytes(ia.address);
  if (want.empty() || want.size() != have.size()) return false;
  if (want == have) return true;
  if (!ia.loopback) return false;
  int bits = ia.prefix_len;
  for (size_t i = 0; i < want.size() && bits > 0; ++i, bits -= 8) {
    unsigned char mask = bits >= 8 ? 0xff : static_cast<unsigned char>(0xff << (8 - bits));
    if ((want[i] & mask) != (have[i] & mask)) return false;
  }
  return true;
}

const InterfaceAddress* HolderOf(const std::vector<InterfaceAddress>& ifs,
                                 const std::string& address) {
  for (const auto& ia : ifs) {
    if (ia.address == address) return &ia;  // exact first: 127.0.0.1 on lo, not on a dummy
  }
  for (const auto& ia : ifs) {
    if (Holds(ia, address)) return &ia;
  }
  return nullptr;
}

std::string DescribeInterfaces(const std::vector<InterfaceAddress>& ifs) {
  std::vector<std::string> items;
  for (const auto& ia : ifs) items.push_back(fmt::format("{} {}", ia.name, ia.address));
  return items.empty() ? "none" : fmt::format("{}", fmt::join(items, ", "));
}

std::string InterfaceNames(const std::vector<InterfaceAddress>& ifs) {
  std::vector<std::string> names;
  for (const auto& ia : ifs) {
    if (std::find(names.begin(), names.end(), ia.name) == names.end()) names.push_back(ia.name);
  }
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace

bool AllLoopback(const std::vector<std::string>& etcd_endpoints) {
  if (etcd_endpoints.empty()) return true;
  for (const auto& e : etcd_endpoints) {
    const std::string host = SplitEndpoint(e).first;
    if (host != "localhost" && !host.ends_with(".localhost") && !IsLoopbackAddress(host)) {
      return false;
    }
  }
  return true;
}

Result<NetworkInputs> SystemNetworkInputs(std::vector<std::string> etcd_endpoints,
                                          std::string advertise_addr, std::string iface) {
  NetworkInputs in;
  in.etcd_endpoints = std::move(etcd_endpoints);
  in.advertise_addr = std::move(advertise_addr);
  in.iface = std::move(iface);
  EFDL_ASSIGN_OR_RETURN(in.interfaces, LocalInterfaceAddresses());
  in.resolve = [](const std::string& host) { return NumericAddresses(host); };
  in.route_source = [](const std::string& address, uint16_t port) {
    return SourceAddressFor(address, port);
  };
  return in;
}

Result<NetworkChoice> ChooseNetwork(const NetworkInputs& in) {
  const bool etcd_loopback = AllLoopback(in.etcd_endpoints);
  const std::string etcd_text =
      in.etcd_endpoints.empty() ? "a private etcd on loopback"
                                : fmt::format("{}", fmt::join(in.etcd_endpoints, ","));

  // The local source address of the route to the first etcd endpoint that has one.
  auto route_to_etcd = [&]() -> Result<std::string> {
    std::string why;
    for (const auto& e : in.etcd_endpoints) {
      auto [host, port] = SplitEndpoint(e);
      auto addrs = in.resolve(host);
      if (!addrs.ok()) {
        why = addrs.status().message();
        continue;
      }
      for (const auto& a : *addrs) {
        auto src = in.route_source(a, port);
        if (src.ok()) return *src;
        why = src.status().message();
      }
    }
    return Status::InvalidArgument(fmt::format(
        "cannot tell which address this host reaches etcd ({}) from: {}; check --etcd, or "
        "give this host's address on the nodes' network with --advertise-addr ADDR or --iface "
        "NAME", etcd_text, why.empty() ? "no endpoint" : why));
  };
  const std::string unreachable_hint =
      "which the other hosts cannot reach (etcd is at " + etcd_text + ")";

  if (!in.iface.empty()) {
    std::vector<InterfaceAddress> own;
    for (const auto& ia : in.interfaces) {
      if (ia.name == in.iface) own.push_back(ia);
    }
    if (own.empty()) {
      return Status::InvalidArgument(fmt::format(
          "--iface {}: this host has no network interface of that name (it has {}); give one "
          "of those (or unset EFDL_IFACE)", in.iface, InterfaceNames(in.interfaces)));
    }
    if (!in.advertise_addr.empty()) {
      auto addrs = in.resolve(in.advertise_addr);
      if (addrs.ok()) {
        for (const auto& a : *addrs) {
          for (const auto& ia : own) {
            if (Holds(ia, a)) {
              return NetworkChoice{a, in.iface, "--advertise-addr and --iface", {}};
            }
          }
        }
      }
      return Status::InvalidArgument(fmt::format(
          "--advertise-addr {} is not an address of --iface {} (which has {}); give an address "
          "of that interface, or only one of the two flags", in.advertise_addr, in.iface,
          DescribeInterfaces(own)));
    }
    bool want_v6 = false;
    if (!etcd_loopback) {
      if (auto src = route_to_etcd(); src.ok()) want_v6 = IsIpv6(*src);
    }
    const InterfaceAddress* pick = nullptr;
    for (int pass = 0; pass < 2 && pick == nullptr; ++pass) {
      for (const auto& ia : own) {
        if (IsLinkLocal6(ia.address)) continue;
        if (pass == 0 && IsIpv6(ia.address) != want_v6) continue;
        pick = &ia;
        break;
      }
    }
    if (pick == nullptr) {
      return Status::InvalidArgument(fmt::format(
          "--iface {} has no address other hosts can use ({}); give an interface with an IPv4 "
          "or global IPv6 address", in.iface, DescribeInterfaces(own)));
    }
    if (IsLoopbackAddress(pick->address) && !etcd_loopback) {
      return Status::InvalidArgument(fmt::format(
          "--iface {} has only the loopback address {}, {}; give the interface of the nodes' "
          "network (this host has {})", in.iface, pick->address, unreachable_hint,
          InterfaceNames(in.interfaces)));
    }
    return NetworkChoice{pick->address, in.iface, "--iface", {}};
  }

  if (!in.advertise_addr.empty()) {
    auto addrs = in.resolve(in.advertise_addr);
    if (!addrs.ok()) {
      return Status::InvalidArgument(fmt::format(
          "--advertise-addr {} does not resolve here ({}); give a numeric address of this host "
          "(it has {})", in.advertise_addr, addrs.status().message(),
          DescribeInterfaces(in.interfaces)));
    }
    for (const auto& a : *addrs) {
      if (const InterfaceAddress* holder = HolderOf(in.interfaces, a)) {
        NetworkChoice choice{a, holder->name, "--advertise-addr", {}};
        if (IsLoopbackAddress(a) && !etcd_loopback) {
          // e.g. --advertise-addr $(hostname) on a host that maps its own name to 127.0.1.1.
          choice.warning = fmt::format("--advertise-addr {} is the loopback address {}, {}",
                                       in.advertise_addr, a, unreachable_hint);
        }
        return choice;
      }
    }
    return Status::InvalidArgument(fmt::format(
        "--advertise-addr {}{} is not an address of this host (it has {}); give one of those, "
        "or leave it unset to use the address this host reaches etcd from", in.advertise_addr,
        *addrs == std::vector<std::string>{in.advertise_addr}
            ? std::string()
            : fmt::format(" ({})", fmt::join(*addrs, ", ")),
        DescribeInterfaces(in.interfaces)));
  }

  if (etcd_loopback) {
    const InterfaceAddress* lo = HolderOf(in.interfaces, "127.0.0.1");
    return NetworkChoice{"127.0.0.1", lo != nullptr ? lo->name : std::string(),
                         "etcd is on loopback", {}};
  }
  EFDL_ASSIGN_OR_RETURN(std::string src, route_to_etcd());
  const InterfaceAddress* holder = HolderOf(in.interfaces, src);
  NetworkChoice choice{src, holder != nullptr ? holder->name : std::string(),
                       fmt::format("the address this host reaches etcd at {} from", etcd_text),
                       {}};
  if (IsLoopbackAddress(src)) {
    // e.g. --etcd $(hostname):2379 on a host that maps its own name to 127.0.1.1.
    choice.warning = fmt::format(
        "etcd at {} is reached over loopback from here, so this node advertises {}, which "
        "other hosts cannot reach; give --etcd as an address the other hosts use too, or "
        "--advertise-addr/--iface", etcd_text, src);
  }
  return choice;
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
    // Not this->~TempDir(): that would end path_'s lifetime before it is assigned.
    TempDir old(std::move(*this));   // removes what this held
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
