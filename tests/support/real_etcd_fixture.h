// A GoogleTest fixture for rendezvous tests against a real etcd: Debian's etcd started on free
// loopback ports in a temporary data directory per test (EmbeddedEtcd), a gRPC client to it, and
// the options and event wait the tests' nodes use.
//
// Ownership: the fixture owns the etcd process and the client; TearDown drops the client first,
// then stops etcd and removes its data directory. Rendezvous objects a test makes on client_
// must be destroyed before TearDown (test-local objects are).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "efdl/embedded_etcd.h"
#include "efdl/etcd.h"
#include "rendezvous/rendezvous.h"

namespace efdl::testing {

class RealEtcdRendezvousTest : public ::testing::Test {
 protected:
  // `job_id` and `last_call` go into every Opts(); the rest of Opts() is the same for all tests.
  RealEtcdRendezvousTest(std::string job_id, std::chrono::milliseconds last_call)
      : job_id_(std::move(job_id)), last_call_(last_call) {}

  void SetUp() override;
  void TearDown() override;

  // A node of job_id_ advertising 127.0.0.1: 10 s lease, 30 s join timeout, 300 ms liveness
  // window (a test sees a crashed node's lease outlive it unless it revokes the lease).
  rdzv::RendezvousOptions Opts(const std::string& node, int min_nodes, int max_nodes) const;

  // The next event of `type` from `r` within `timeout` (other events are skipped).
  static std::optional<rdzv::Event> Next(rdzv::Rendezvous& r, rdzv::Event::Type type,
                                         std::chrono::milliseconds timeout = std::chrono::seconds(15));

  std::unique_ptr<EmbeddedEtcd> etcd_;
  std::unique_ptr<etcd::Client> client_;

 private:
  std::string job_id_;
  std::chrono::milliseconds last_call_;
};

}  // namespace efdl::testing
