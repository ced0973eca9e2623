// The gRPC side of the etcd client: one channel (and its stubs) per endpoint, which endpoint to
// try first, and the translation of gRPC failures into efdl::Status.
//
// Thread-safety: all methods may be called from any thread. The channels and stubs are created
// once, in the constructor, and never change; only the preferred index moves.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "efdl/etcd.h"
#include "rpc.grpc.pb.h"

namespace efdl::etcd {

struct EndpointChannel {
  std::string address;  // "host:port", as the user gave it
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch;
};

class ChannelSet {
 public:
  explicit ChannelSet(const std::vector<std::string>& endpoints);

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

 private:
  std::vector<EndpointChannel> endpoints_;
  std::atomic<size_t> preferred_{0};
};

// A gRPC failure as a Status whose message names the operation and the endpoint.
Status FromGrpc(const grpc::Status& status, std::string_view operation,
                std::string_view endpoint);

// gRPC failures worth trying again (elsewhere or later): the request did not get an answer
// because the endpoint or its raft leader was unavailable.
bool IsRetriableGrpc(const grpc::Status& status);

}  // namespace efdl::etcd
