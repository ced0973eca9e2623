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
  // The in-memory tests' options, with more slack for a real etcd and the default takeover step.
  rdzv::RendezvousOptions o = FastRendezvousOptions(job_id_, node, min_nodes, max_nodes);
  o.last_call = last_call_;
  o.join_timeout = 30s;
  o.liveness_window = 300ms;
  o.takeover_step = rdzv::RendezvousOptions{}.takeover_step;
  return o;
}

std::optional<rdzv::Event> RealEtcdRendezvousTest::Next(rdzv::Rendezvous& r,
                                                        rdzv::Event::Type type,
                                                        std::chrono::milliseconds timeout) {
  return NextEvent(r, type, timeout);
}

}  // namespace efdl::testing
