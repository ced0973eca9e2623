// The gRPC side of the etcd client: one channel (and its stubs) per endpoint, which endpoint to
// try first, the auth token every call carries, and the translation of gRPC failures into
// efdl::Status.
//
// Thread-safety: all methods may be called from any thread. The channels and stubs are created
// once, in the constructor, and never change; only the preferred index and the token move.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "efdl/etcd.h"
#include "rpc.grpc.pb.h"

namespace efdl::etcd {

struct EndpointChannel {
  std::string address;  // "host:port", as the user gave it
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  std::unique_ptr<etcdserverpb::Auth::Stub> auth;
  std::unique_ptr<etcdserverpb::Maintenance::Stub> maintenance;
};

// Reads the PEM files named by `tls` into gRPC TLS credentials; nullptr when TLS is off. Fails
// with one line naming the option and file when one cannot be read, or a certificate is given
// without its key (or the other way round).
Result<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsOptions& tls);

class ChannelSet {
 public:
  // `credentials`: TLS credentials, or nullptr for plaintext. `user` empty: no etcd auth.
  ChannelSet(const std::vector<std::string>& endpoints,
             std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
             std::string user = {}, std::string password = {});

  size_t size() const { return endpoints_.size(); }
  EndpointChannel& at(size_t i) { return endpoints_[i]; }
  // The endpoint to try first: the last one that answered (initially the first listed).
  size_t preferred() const { return preferred_.load(std::memory_order_relaxed); }
  void MarkGood(size_t i) { preferred_.store(i, std::memory_order_relaxed); }
  // Moves the preference past `i` when `i` is the preferred one (another thread may already
  // have moved it to an endpoint that works).
  void MarkBad(size_t i);
  // "127.0.0.1:2379, 127.0.0.1:22379"
  std::string Describe() const;

  // --- etcd auth (no-ops without a user) ---
  bool auth_enabled() const { return !user_.empty(); }
  const std::string& user() const { return user_; }
  // The token to send now ("" before the first Authenticate or without auth).
  std::string token() const;
  // Adds `token` as the "token" metadata (nothing when empty).
  static void AttachToken(grpc::ClientContext* context, const std::string& token);
  // Gets a new token from etcd unless another thread already replaced `stale` (pass the token
  // the failed call carried; "" for the first time). Tries each endpoint once within `timeout`.
  // Wrong credentials: InvalidArgument naming the user and the flags to fix.
  Status Authenticate(const std::string& stale, Duration timeout);
  // A call carrying the current token succeeded: etcd extended its life.
  void NoteTokenUsed();
  // For a stream about to open (streams do not extend a simple token's life, and a watch
  // created with an expired one is refused): re-authenticates first when no call has used the
  // token for a while. Returns the token to attach.
  std::string TokenForStream(Duration timeout);

 private:
  std::vector<EndpointChannel> endpoints_;
  std::atomic<size_t> preferred_{0};
  const std::string user_;
  const std::string password_;
  mutable Mutex token_mu_;        // also serializes Authenticate calls
  std::string token_ EFDL_GUARDED_BY(token_mu_);
  std::atomic<int64_t> token_used_ns_{0};  // steady clock of the last proof the token is good
};

// True when etcd refused the call's token as invalid or expired (or outdated after an auth
// change): authenticate again and repeat the call (it was not executed).
bool IsStaleTokenGrpc(const grpc::Status& status);


// A gRPC failure as a Status whose message names the operation and the endpoint.
Status FromGrpc(const grpc::Status& status, std::string_view operation,
                std::string_view endpoint);

// gRPC failures worth trying again (elsewhere or later): the request did not get an answer
// because the endpoint or its raft leader was unavailable.
bool IsRetriableGrpc(const grpc::Status& status);

}  // namespace efdl::etcd
