#include "support/real_etcd_fixture.h"

#include "support/rendezvous_events.h"

namespace efdl::testing {

using namespace std::chrono_literals;

void RealEtcdRendezvousTest::SetUp() {
  auto started = EmbeddedEtcd::Start({});
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  etcd_ = std::move(*started);
  etcd::ClientOptions o;
  o.endpoints = {etcd_->endpoint()};
  auto c = etcd::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  client_ = std::move(*c);
}

void RealEtcdRendezvousTest::TearDown() {
  client_.reset();
  etcd_.reset();
}

rdzv::RendezvousOptions RealEtcdRendezvousTest::Opts(const std::string& node, int min_nodes,
                                                     int max_nodes) const {
  rdzv::RendezvousOptions o;
  o.job_id = job_id_;
  o.node_id = node;
  o.advertise_addr = "127.0.0.1";
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.ttl = 10s;
  o.last_call = last_call_;
  o.join_timeout = 30s;
  o.liveness_window = 300ms;
  return o;
}

std::optional<rdzv::Event> RealEtcdRendezvousTest::Next(rdzv::Rendezvous& r,
                                                        rdzv::Event::Type type,
                                                        std::chrono::milliseconds timeout) {
  return NextEvent(r, type, timeout);
}

}  // namespace efdl::testing
