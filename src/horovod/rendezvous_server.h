// Horovod's Gloo rendezvous server: the HTTP key-value store that `hvd.init()` (Gloo controller)
// talks to when HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT point at it.
//
//   GET    /<T>/<scope>/<key>   200 + the value, or 404 until someone PUTs it (clients poll)
//   PUT    /<T>/<scope>/<key>   200; the body (Content-Length bytes, any bytes) is the value
//   DELETE /<T>/<scope>/<rank>  200; see RendezvousStore for when a scope is cleared
//   GET    /<T>/rank_and_size/<host>:<local rank>  "rank,size,local_rank,local_size,
//                                          cross_rank,cross_size" (all -1: not in this round)
//
// <T> is the round's token, optionally followed by ":<digits>": a request without it is
// refused (403). Real Horovod carries it without knowing: it builds its URLs as
// "http://" + HOROVOD_GLOO_RENDEZVOUS_ADDR + ":" + PORT + "/" + scope + "/" + key, and the
// agent sets the address to "<address>:<port>/<token>" (WorkerEnv), so the URL's host part
// is the real address and port and its path starts with "/<token>:<port>/".
//
// Every response carries "Connection: close" and the connection is closed after it, as with
// Horovod's own (HTTP/1.0) server: its C++ client opens one connection per request.
//
// The rank-0 node's agent starts one per round (or calls SetRound on the old one) and gives its
// address and port to every worker through WorkerEnvForHost.
//
// Threading: one background thread serves all connections (poll loop); it is owned by the
// server and joined by Stop() / the destructor. All public methods are thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "efdl/status.h"
#include "horovod/rendezvous_store.h"
#include "horovod/slots.h"

namespace efdl::horovod {

struct RendezvousServerOptions {
  // The interface the workers reach (the node's advertise address); "0.0.0.0" for every one.
  std::string bind_addr = "127.0.0.1";
  uint16_t port = 0;  // 0: pick a free port (read it back with port())
  // Required: the first path segment of every request (see above); 32-128 characters of
  // [0-9a-f] (RendezvousToken makes one). Start refuses to serve without it.
  std::string token;
  // Non-empty: besides the token, only connections from these numeric IP addresses are served;
  // others get 403 (the round's member addresses are known up front).
  std::vector<std::string> allowed_clients;
  size_t max_header_bytes = 16 * 1024;
  size_t max_body_bytes = 16 * 1024 * 1024;
  // A connection must deliver its whole request, and later take its whole response, within this.
  std::chrono::milliseconds request_timeout{std::chrono::seconds(10)};
  // Connections beyond this wait in the listen backlog.
  size_t max_connections = 512;
};

// The token of one round of one job: 32 hex digits of HMAC-SHA256(job secret, "efdl horovod
// rendezvous round <round>"). Every agent of the job computes the same one, no one without the
// job's secret can, and a token seen in a worker's log opens no other round. Fails on an empty
// secret (fail closed: no token, no server).
Result<std::string> RendezvousToken(std::string_view job_secret, int64_t round);

// The value of HOROVOD_GLOO_RENDEZVOUS_ADDR that makes Horovod's URLs carry `token`.
std::string HorovodAddrWithToken(const std::string& address, uint16_t port,
                                 const std::string& token);

class RendezvousServer {
 public:
  // Binds, listens and starts the serving thread. Fails with one clear line when the address
  // cannot be resolved or bound, or the options are unusable.
  static Result<std::unique_ptr<RendezvousServer>> Start(RendezvousServerOptions options,
                                                         const std::vector<SlotInfo>& round);

  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;
  ~RendezvousServer();

  // Closes the listening socket and every open connection (clients see the connection end) and
  // joins the thread. Idempotent.
  void Stop();

  const std::string& address() const { return bind_addr_; }
  uint16_t port() const { return port_; }

  // Starts a new round on the same port: new scope sizes, all values and DELETEs forgotten.
  void SetRound(const std::vector<SlotInfo>& round) { store_.Reset(round); }
  RendezvousStore& store() { return store_; }

  struct Stats {
    uint64_t requests = 0;   // complete requests answered (any status)
    uint64_t rejected = 0;   // answered with a 4xx/5xx other than 404
    uint64_t timed_out = 0;  // connections dropped for exceeding request_timeout
  };
  Stats stats() const;

 private:
  struct Connection;
  RendezvousServer(RendezvousServerOptions options, int listen_fd, int wake_fd, uint16_t port,
                   const std::vector<SlotInfo>& round);
  void Loop();
  void OnReadable(Connection& c);
  void OnWritable(Connection& c);
  void Respond(Connection& c);
  // Checks the client and strips the token from `target`, leaving "/<scope>/<key>".
  bool Authorized(const Connection& c, std::string* target, std::string* why) const;

  const RendezvousServerOptions options_;
  const int listen_fd_;
  const int wake_fd_;
  const std::string bind_addr_;
  const uint16_t port_;
  RendezvousStore store_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> requests_{0};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> timed_out_{0};
  std::thread thread_;  // last: starts after everything it uses exists
};

}  // namespace efdl::horovod
