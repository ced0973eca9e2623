// Small socket and filesystem helpers shared by the agent, the embedded etcd and tests.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
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

// One address of one network interface of this machine (getifaddrs).
struct InterfaceAddress {
  std::string name;         // "eth0", "lo"
  std::string address;      // numeric, canonical ("10.0.0.2", "fe80::1")
  int prefix_len = 0;       // of the interface's network (127.0.0.1/8 on lo: 8)
  bool loopback = false;    // IFF_LOOPBACK
  bool up = false;          // IFF_UP
};
// Every IPv4/IPv6 address of every interface, in the kernel's order.
Result<std::vector<InterfaceAddress>> LocalInterfaceAddresses();
// The source address the kernel picks for traffic to `address` (numeric) on `port`: a UDP
// socket is connect()ed there (no packet is sent) and its local address read back. Unavailable
// when there is no route (ENETUNREACH and the like).
Result<std::string> SourceAddressFor(const std::string& address, uint16_t port);

// How this node is reached by its peers: the advertise address (numeric; MASTER_ADDR when the
// node is rank 0) and the interface that holds it (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME,
// HOROVOD_GLOO_IFACE), and one phrase saying how they were chosen (for the log).
struct NetworkChoice {
  std::string address;
  std::string iface;
  std::string how;
  std::string warning;      // non-empty: a choice that works only on this host (say it)
};

// What ChooseNetwork decides from; the functions are the system's in production (see
// SystemNetworkInputs) and fakes in tests.
struct NetworkInputs {
  std::vector<std::string> etcd_endpoints;   // "host:port" / "[v6]:port"; empty: loopback etcd
  std::string advertise_addr;                // --advertise-addr; empty: choose
  std::string iface;                         // --iface; empty: choose
  std::vector<InterfaceAddress> interfaces;
  // A host name or literal -> its numeric addresses (NumericAddresses).
  std::function<Result<std::vector<std::string>>(const std::string&)> resolve;
  // A numeric address and port -> the local source address of a route there (SourceAddressFor).
  std::function<Result<std::string>(const std::string&, uint16_t)> route_source;
};

// The network inputs of this machine for the given flags.
Result<NetworkInputs> SystemNetworkInputs(std::vector<std::string> etcd_endpoints,
                                          std::string advertise_addr, std::string iface);

// The decision, pure over its inputs:
// - --iface NAME: NAME must be an interface here; the address is --advertise-addr (which NAME
//   must hold) or NAME's address of the family the route to etcd uses (IPv4 first otherwise;
//   never an IPv6 link-local one, which needs a scope to be reached).
// - --advertise-addr ADDR: ADDR (or, for a name, one of its addresses) must be held by an
//   interface here; a name becomes its numeric address.
// - neither: 127.0.0.1 on the loopback interface when every etcd endpoint is loopback; else the
//   source address of the route to the first etcd endpoint that resolves and has a route.
// A loopback address while etcd is not loopback, an interface or address this host does not
// have, and no route to etcd are InvalidArgument with one line saying what to do.
Result<NetworkChoice> ChooseNetwork(const NetworkInputs& in);

// True when every endpoint's host is a loopback name or address (localhost, 127.x, ::1).
bool AllLoopback(const std::vector<std::string>& etcd_endpoints);

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
