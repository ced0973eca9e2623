// A real etcd server (Debian's /usr/bin/etcd) run as our child on loopback: for tests, and for
// single-machine use (`efdl etcd`, and `efdl run` without a given etcd).
//
// Ownership: the EmbeddedEtcd owns the etcd process (stopped by the destructor) and, when it
// made it, the temporary data directory <tmp>/efdl-etcd-XXXXXX (removed by the destructor; should
// this process die without running it - SIGKILL, the OOM killer - a GroupReaper it forks for the
// purpose kills etcd and removes the directory, and the directory's owner file lets the next
// `efdl run`/`efdl sim`/`efdl snapshots gc` tell a dead owner's directory from a live one:
// src/etcd/private_dirs.h). A temporary etcd also runs with settings that keep it small
// (docs/operations.md, "Private etcd"). etcd's output goes to
// `log_path()` inside the data directory. The child is spawned with die_with_parent: it is
// killed when the thread that called Start()/Restart() exits, so call them from a thread that
// lives as long as the etcd should. Not thread-safe: one owner drives it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "efdl/status.h"

namespace efdl {

struct EmbeddedEtcdOptions {
  std::string data_dir;             // empty: a fresh temporary directory, removed at the end
                                    // (also when this process is killed)
  std::string host = "127.0.0.1";   // listen and advertise address (loopback by default)
  uint16_t client_port = 0;         // 0: a free port
  uint16_t peer_port = 0;           // 0: a free port
  std::string name = "efdl";        // member name
  std::string binary = "etcd";      // looked up in PATH
  std::chrono::milliseconds start_timeout{std::chrono::seconds(20)};
  // Membership of a multi-member cluster ("name=http://host:peer_port,..."), with fixed ports;
  // empty: a one-member cluster of this etcd alone. See EmbeddedEtcdCluster.
  std::string initial_cluster;
  // false: Start returns once etcd is spawned (a cluster member cannot serve before a quorum
  // of members runs); call WaitUntilHealthy later.
  bool wait_until_healthy = true;
  // Non-empty cert_file: clients connect over TLS (https) to etcd's --cert-file/--key-file;
  // non-empty trusted_ca_file also requires client certificates signed by it
  // (--client-cert-auth). The health check connects with `health_tls`.
  std::string cert_file;
  std::string key_file;
  std::string trusted_ca_file;
  etcd::TlsOptions health_tls;
  std::vector<std::string> extra_args;  // appended to etcd's command line (e.g. --auth-token-ttl)
};

class EmbeddedEtcd {
 public:
  // Starts etcd and waits until it serves a real request. With automatic ports, a port taken
  // by someone else between picking and binding is retried with fresh ports.
  static Result<std::unique_ptr<EmbeddedEtcd>> Start(EmbeddedEtcdOptions options);

  EmbeddedEtcd(const EmbeddedEtcd&) = delete;
  EmbeddedEtcd& operator=(const EmbeddedEtcd&) = delete;
  ~EmbeddedEtcd();  // Stop(), then removes a temporary data directory

  // "127.0.0.1:23790": what clients connect to.
  std::string endpoint() const;
  uint16_t client_port() const { return client_port_; }
  uint16_t peer_port() const { return peer_port_; }
  const std::string& data_dir() const { return data_dir_; }
  std::string log_path() const;
  bool running();
  int pid() const;
  // The GOGC etcd runs with: the caller's environment's when it sets one; else 400 for a private
  // etcd (a temporary data directory; src/etcd/embedded_etcd.cc says why) and Go's default,
  // "100", for another.
  const std::string& go_gc() const { return go_gc_; }

  // SIGTERM, then SIGKILL after `grace`; waits until the process is gone. Idempotent.
  Status Stop(std::chrono::milliseconds grace = std::chrono::seconds(5));
  // SIGKILL at once (a crash, for tests); waits until the process is gone.
  Status Kill();
  // Starts again on the same data directory and ports (after Stop or Kill); waits until
  // healthy. Data written before survives.
  Status Restart();
  // Waits until it serves a real (linearizable) request, up to options.start_timeout.
  Status WaitUntilHealthy();

 private:
  explicit EmbeddedEtcd(EmbeddedEtcdOptions options);
  Status Launch(bool wait);

  struct Impl;
  EmbeddedEtcdOptions options_;
  std::string data_dir_;
  std::string go_gc_;
  uint16_t client_port_ = 0;
  uint16_t peer_port_ = 0;
  std::unique_ptr<Impl> impl_;
};

// A multi-member etcd cluster on loopback (default 3 members), each member an EmbeddedEtcd with
// its own ports and data directory: for failover tests. Same ownership rules as EmbeddedEtcd.
class EmbeddedEtcdCluster {
 public:
  static Result<std::unique_ptr<EmbeddedEtcdCluster>> Start(
      int members = 3, std::chrono::milliseconds start_timeout = std::chrono::seconds(30));

  // "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
  std::string endpoints() const;
  size_t size() const { return members_.size(); }
  EmbeddedEtcd& member(size_t i) { return *members_.at(i); }

 private:
  EmbeddedEtcdCluster() = default;
  std::vector<std::unique_ptr<EmbeddedEtcd>> members_;
};

}  // namespace efdl
