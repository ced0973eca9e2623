// The etcd client against a real etcd (one per test suite, started on free loopback ports):
// KV, transactions, leases and watches.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <barrier>
#include <mutex>
#include <thread>

#include "common/subprocess.h"
#include "efdl/embedded_etcd.h"
#include "efdl/etcd.h"
#include "test_util.h"

namespace efdl::etcd {
namespace {

using namespace std::chrono_literals;
using testing::WaitUntil;

class EtcdClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto etcd = EmbeddedEtcd::Start({});
    ASSERT_TRUE(etcd.ok()) << etcd.status().ToString();
    etcd_ = std::move(etcd).value().release();
  }
  static void TearDownTestSuite() {
    delete etcd_;
    etcd_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(etcd_, nullptr);
    client_ = NewClient();
    prefix_ = std::string("/test/") +
              ::testing::UnitTest::GetInstance()->current_test_info()->name() + "/";
  }

  static std::unique_ptr<Client> NewClient() {
    ClientOptions options;
    options.endpoints = {etcd_->endpoint()};
    auto client = Connect(options);
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    return client.ok() ? std::move(client).value() : nullptr;
  }

  // Writes `key` and waits until a fresh watch of it, on the same client, delivers the write.
  // The client's watches share one stream that etcd fills in revision order, so an update for
  // another watch that was written before `key` would have arrived by then: what a watch under
  // test has not received now, it will not receive (instead of waiting a fixed window).
  void WaitForWitness(const std::string& key) {
    std::atomic<bool> seen{false};
    auto witness = client_->StartWatch(key, {}, [&](const WatchUpdate& u) {
      for (const auto& e : u.events) {
        if (e.kv.key == key) seen = true;
      }
    });
    ASSERT_TRUE(witness.ok()) << witness.status().ToString();
    ASSERT_TRUE(client_->Put(key, "witness").ok());
    ASSERT_TRUE(WaitUntil([&] { return seen.load(); }, 20s)) << "the witness saw nothing";
  }

  static EmbeddedEtcd* etcd_;
  std::unique_ptr<Client> client_;
  std::string prefix_;
};

EmbeddedEtcd* EtcdClientTest::etcd_ = nullptr;

TEST_F(EtcdClientTest, PutGetPrefixDeleteRoundTrip) {
  auto put_a = client_->Put(prefix_ + "a", "1");
  ASSERT_TRUE(put_a.ok()) << put_a.status().ToString();
  auto put_b = client_->Put(prefix_ + "b", std::string("two\0bytes", 9));
  ASSERT_TRUE(put_b.ok());
  EXPECT_GT(put_b->revision, put_a->revision);
  ASSERT_TRUE(client_->Put(prefix_ + "c/d", "3").ok());
  ASSERT_TRUE(client_->Put(prefix_.substr(0, prefix_.size() - 1) + "X", "outside").ok());

  auto a = client_->Get(prefix_ + "a");
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(a->has_value());
  EXPECT_EQ((*a)->value, "1");
  EXPECT_EQ((*a)->mod_revision, put_a->revision);
  EXPECT_EQ((*a)->version, 1);

  auto missing = client_->Get(prefix_ + "nope");
  ASSERT_TRUE(missing.ok());
  EXPECT_FALSE(missing->has_value());

  RangeOptions all;
  all.prefix = true;
  auto range = client_->Range(prefix_, all);
  ASSERT_TRUE(range.ok());
  ASSERT_EQ(range->kvs.size(), 3u);
  EXPECT_EQ(range->kvs[1].value, std::string("two\0bytes", 9));
  EXPECT_EQ(range->kvs[2].key, prefix_ + "c/d");
  EXPECT_GE(range->revision, put_b->revision);

  RangeOptions limited = all;
  limited.limit = 2;
  auto first_two = client_->Range(prefix_, limited);
  ASSERT_TRUE(first_two.ok());
  EXPECT_EQ(first_two->kvs.size(), 2u);
  EXPECT_EQ(first_two->count, 3);
  EXPECT_TRUE(first_two->more);

  RangeOptions old = all;
  old.revision = put_a->revision;  // the store as it was right after the first put
  auto then = client_->Range(prefix_, old);
  ASSERT_TRUE(then.ok());
  ASSERT_EQ(then->kvs.size(), 1u);

  auto del_one = client_->Delete(prefix_ + "a");
  ASSERT_TRUE(del_one.ok());
  EXPECT_EQ(del_one->deleted, 1);
  auto del_rest = client_->Delete(prefix_, /*prefix=*/true);
  ASSERT_TRUE(del_rest.ok());
  EXPECT_EQ(del_rest->deleted, 2);
  auto after = client_->Range(prefix_, all);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->kvs.empty());
  auto outside = client_->Get(prefix_.substr(0, prefix_.size() - 1) + "X");
  ASSERT_TRUE(outside.ok());
  EXPECT_TRUE(outside->has_value()) << "a prefix delete must not touch keys outside the prefix";
}

TEST_F(EtcdClientTest, RangeSortsByCreateRevisionAndFiltersOnIt) {
  // Created in the order c, a, b: key order differs from creation order.
  std::vector<int64_t> created;
  for (const char* k : {"c", "a", "b"}) {
    auto put = client_->Put(prefix_ + k, k);
    ASSERT_TRUE(put.ok());
    created.push_back(put->revision);
  }
  RangeOptions o;
  o.prefix = true;
  o.sort_order = RangeOptions::SortOrder::kAscend;
  o.sort_target = RangeOptions::SortTarget::kCreateRevision;
  auto sorted = client_->Range(prefix_, o);
  ASSERT_TRUE(sorted.ok());
  ASSERT_EQ(sorted->kvs.size(), 3u);
  EXPECT_EQ(sorted->kvs[0].value, "c");
  EXPECT_EQ(sorted->kvs[2].value, "b");

  o.sort_order = RangeOptions::SortOrder::kDescend;
  o.limit = 1;
  auto newest = client_->Range(prefix_, o);
  ASSERT_TRUE(newest.ok());
  ASSERT_EQ(newest->kvs.size(), 1u);
  EXPECT_EQ(newest->kvs[0].value, "b");

  RangeOptions before_b;
  before_b.prefix = true;
  before_b.max_create_revision = created[2] - 1;  // every key created before "b"
  auto older = client_->Range(prefix_, before_b);
  ASSERT_TRUE(older.ok());
  ASSERT_EQ(older->kvs.size(), 2u);
  EXPECT_EQ(older->kvs[0].value, "a");
  EXPECT_EQ(older->kvs[1].value, "c");
}

TEST_F(EtcdClientTest, CasRaceBetweenTwoClientsHasExactlyOneWinner) {
  auto other = NewClient();
  ASSERT_NE(other, nullptr);
  constexpr int kRounds = 20;
  for (int round = 0; round < kRounds; ++round) {
    const std::string key = prefix_ + std::to_string(round);
    std::barrier start(2);
    std::array<Result<TxnResult>, 2> results{Status::Internal("not run"),
                                             Status::Internal("not run")};
    auto contend = [&](int who, Client* c) {
      start.arrive_and_wait();
      results[who] = c->Txn({Compare::KeyMissing(key)}, {TxnOp::Put(key, std::to_string(who))},
                            {TxnOp::Get(key)});
    };
    std::thread t0(contend, 0, client_.get());
    std::thread t1(contend, 1, other.get());
    t0.join();
    t1.join();
    ASSERT_TRUE(results[0].ok()) << results[0].status().ToString();
    ASSERT_TRUE(results[1].ok()) << results[1].status().ToString();
    ASSERT_NE(results[0]->succeeded, results[1]->succeeded) << "round " << round;
    const int winner = results[0]->succeeded ? 0 : 1;
    const TxnResult& loser = *results[1 - winner];
    ASSERT_EQ(loser.gets.size(), 1u);
    ASSERT_EQ(loser.gets[0].kvs.size(), 1u);
    EXPECT_EQ(loser.gets[0].kvs[0].value, std::to_string(winner)) << "the loser sees the winner";
    auto stored = client_->Get(key);
    ASSERT_TRUE(stored.ok());
    EXPECT_EQ((*stored)->value, std::to_string(winner));
  }
}

TEST_F(EtcdClientTest, TxnGuardsOnModRevisionAndValue) {
  auto put = client_->Put(prefix_ + "k", "v1");
  ASSERT_TRUE(put.ok());
  auto stale = client_->Txn({Compare::ModRevisionIs(prefix_ + "k", put->revision - 1)},
                            {TxnOp::Put(prefix_ + "k", "wrong")});
  ASSERT_TRUE(stale.ok());
  EXPECT_FALSE(stale->succeeded);
  auto fresh = client_->Txn({Compare::ModRevisionIs(prefix_ + "k", put->revision),
                             Compare::ValueIs(prefix_ + "k", "v1")},
                            {TxnOp::Put(prefix_ + "k", "v2"), TxnOp::Get(prefix_ + "k")});
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE(fresh->succeeded);
  EXPECT_GT(fresh->revision, put->revision);
  ASSERT_EQ(fresh->gets.size(), 1u);
  EXPECT_EQ(fresh->gets[0].kvs.at(0).value, "v2");
  auto version = client_->Txn({Compare::VersionIs(prefix_ + "k", 2)},
                              {TxnOp::Delete(prefix_, /*prefix=*/true)});
  ASSERT_TRUE(version.ok());
  EXPECT_TRUE(version->succeeded);
  auto gone = client_->Get(prefix_ + "k");
  ASSERT_TRUE(gone.ok());
  EXPECT_FALSE(gone->has_value());
}

TEST_F(EtcdClientTest, LeasedKeyStaysWhileKeptAndVanishesWithinTtlPlusOneSecondAfter) {
  auto lease = client_->LeaseGrant(2);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  const int64_t ttl = lease->ttl_seconds;  // etcd may raise a TTL to its minimum
  ASSERT_GE(ttl, 2);
  ASSERT_TRUE(client_->Put(prefix_ + "node", "alive", lease->id).ok());
  std::atomic<int> lost_calls{0};
  auto keeper = client_->KeepAlive(lease->id, [&] { ++lost_calls; });
  ASSERT_TRUE(keeper.ok()) << keeper.status().ToString();

  const auto kept_until = std::chrono::steady_clock::now() + std::chrono::seconds(3 * ttl);
  while (std::chrono::steady_clock::now() < kept_until) {
    auto kv = client_->Get(prefix_ + "node");
    ASSERT_TRUE(kv.ok());
    ASSERT_TRUE(kv->has_value()) << "the key vanished while its lease was kept alive";
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_EQ(lost_calls.load(), 0);
  EXPECT_FALSE((*keeper)->lost());

  keeper->reset();  // stop renewing
  const auto stopped = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto kv = client_->Get(prefix_ + "node");
        return kv.ok() && !kv->has_value();
      },
      std::chrono::seconds(ttl + 3)));
  const auto took = std::chrono::steady_clock::now() - stopped;
  EXPECT_LE(took, std::chrono::seconds(ttl + 1))
      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  EXPECT_EQ(lost_calls.load(), 0) << "a dropped keeper does not report loss";
}

TEST_F(EtcdClientTest, OwnerIsToldOnceWhenItsLeaseIsRevokedElsewhere) {
  auto lease = client_->LeaseGrant(3);
  ASSERT_TRUE(lease.ok());
  std::atomic<int> lost_calls{0};
  auto keeper = client_->KeepAlive(lease->id, [&] { ++lost_calls; });
  ASSERT_TRUE(keeper.ok());
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE((*keeper)->lost());

  auto other = NewClient();
  ASSERT_NE(other, nullptr);
  const auto revoked = std::chrono::steady_clock::now();
  ASSERT_TRUE(other->LeaseRevoke(lease->id).ok());
  // The next renewal (every TTL/3) learns it is gone.
  ASSERT_TRUE(WaitUntil([&] { return lost_calls.load() > 0; }, 5s));
  EXPECT_LE(std::chrono::steady_clock::now() - revoked, std::chrono::seconds(lease->ttl_seconds));
  EXPECT_TRUE((*keeper)->lost());
  std::this_thread::sleep_for(std::chrono::seconds(lease->ttl_seconds));
  EXPECT_EQ(lost_calls.load(), 1);

  auto ttl = client_->LeaseTimeToLive(lease->id);
  EXPECT_TRUE(ttl.status().IsNotFound()) << ttl.status().ToString();
  auto again = client_->KeepAlive(lease->id, [] {});
  EXPECT_TRUE(again.status().IsNotFound()) << again.status().ToString();
}

TEST_F(EtcdClientTest, WatchDeliversPrefixEventsInRevisionOrder) {
  std::mutex mu;
  std::vector<WatchEvent> events;
  WatchOptions options;
  options.prefix = true;
  auto watch = client_->StartWatch(prefix_, options, [&](const WatchUpdate& u) {
    ASSERT_TRUE(u.error.ok()) << u.error.ToString();
    std::lock_guard<std::mutex> lock(mu);
    events.insert(events.end(), u.events.begin(), u.events.end());
  });
  ASSERT_TRUE(watch.ok()) << watch.status().ToString();
  constexpr int kKeys = 40;
  std::vector<int64_t> revisions;
  for (int i = 0; i < kKeys; ++i) {
    auto put = client_->Put(prefix_ + std::to_string(i % 7), std::to_string(i));
    ASSERT_TRUE(put.ok());
    revisions.push_back(put->revision);
    if (i % 10 == 9) {
      auto del = client_->Delete(prefix_ + std::to_string(i % 7));
      ASSERT_TRUE(del.ok());
      revisions.push_back(del->revision);
    }
  }
  ASSERT_TRUE(client_->Put(prefix_.substr(0, prefix_.size() - 1), "not in the prefix").ok());
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        return events.size() >= revisions.size();
      },
      10s));
  watch->reset();
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(events.size(), revisions.size());
  int deletes = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    EXPECT_EQ(events[i].kv.mod_revision, revisions[i]) << i;
    if (events[i].type == WatchEvent::Type::kDelete) ++deletes;
  }
  EXPECT_EQ(deletes, kKeys / 10);
}

// WatchOptions::wait_created = false (issue #37: a registration starts its three watches
// together and waits once): StartWatch returns without a round trip, even while etcd does not
// answer at all; WaitCreated then waits for etcd, and the watch delivers from its revision.
TEST_F(EtcdClientTest, AWatchStartedWithoutWaitingReturnsAtOnceAndDeliversFromItsRevision) {
  auto before = client_->Put(prefix_ + "k", "before");
  ASSERT_TRUE(before.ok());
  std::mutex mu;
  std::vector<std::string> values;
  const WatchOptions queued{.start_revision = before->revision, .wait_created = false};
  ASSERT_EQ(::kill(etcd_->pid(), SIGSTOP), 0);
  struct Resume {
    int pid;
    ~Resume() { ::kill(pid, SIGCONT); }
  } resume{etcd_->pid()};
  const auto started = std::chrono::steady_clock::now();
  auto watch = client_->StartWatch(prefix_ + "k", queued, [&](const WatchUpdate& u) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& e : u.events) values.push_back(e.kv.value);
  });
  const auto took = std::chrono::steady_clock::now() - started;
  ASSERT_TRUE(watch.ok()) << watch.status().ToString();
  EXPECT_LT(took, 1s) << "StartWatch waited for a stopped etcd";
  ASSERT_EQ(::kill(etcd_->pid(), SIGCONT), 0);
  ASSERT_TRUE((*watch)->WaitCreated().ok());
  ASSERT_TRUE(client_->Put(prefix_ + "k", "after").ok());
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        return values.size() >= 2;
      },
      10s));
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(values, (std::vector<std::string>{"before", "after"}));
}

TEST_F(EtcdClientTest, ManyWatchesShareOneClientAndEachGetsItsOwnKeys) {
  constexpr int kWatches = 20;
  std::mutex mu;
  std::vector<std::vector<std::string>> seen(kWatches);
  std::vector<std::unique_ptr<Watch>> watches;
  for (int w = 0; w < kWatches; ++w) {
    auto watch = client_->StartWatch(prefix_ + std::to_string(w) + "/", {.prefix = true},
                                     [&, w](const WatchUpdate& u) {
                                       std::lock_guard<std::mutex> lock(mu);
                                       for (const auto& e : u.events) seen[w].push_back(e.kv.value);
                                     });
    ASSERT_TRUE(watch.ok());
    watches.push_back(std::move(*watch));
  }
  for (int w = 0; w < kWatches; ++w) {
    ASSERT_TRUE(client_->Put(prefix_ + std::to_string(w) + "/k", std::to_string(w)).ok());
  }
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        for (const auto& s : seen) {
          if (s.empty()) return false;
        }
        return true;
      },
      10s));
  watches.clear();
  std::lock_guard<std::mutex> lock(mu);
  for (int w = 0; w < kWatches; ++w) {
    EXPECT_EQ(seen[w], std::vector<std::string>{std::to_string(w)}) << w;
  }
}

TEST_F(EtcdClientTest, WatchFromCompactedRevisionIsReportedAsCompaction) {
  auto first = client_->Put(prefix_ + "k", "1");
  ASSERT_TRUE(first.ok());
  auto second = client_->Put(prefix_ + "k", "2");
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(client_->Compact(second->revision).ok());

  std::mutex mu;
  std::vector<WatchUpdate> updates;
  WatchOptions options;
  options.start_revision = first->revision;
  auto watch = client_->StartWatch(prefix_ + "k", options, [&](const WatchUpdate& u) {
    std::lock_guard<std::mutex> lock(mu);
    updates.push_back(u);
  });
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(WaitUntil(
      [&] {
        std::lock_guard<std::mutex> lock(mu);
        return !updates.empty();
      },
      10s));
  ASSERT_TRUE(client_->Put(prefix_ + "k", "after the compaction").ok());
  WaitForWitness(prefix_ + "witness");
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(updates.size(), 1u) << "a compacted watch ends with that one update";
  EXPECT_TRUE(updates[0].compacted);
  EXPECT_EQ(updates[0].compact_revision, second->revision);
  EXPECT_TRUE(updates[0].events.empty());
  EXPECT_TRUE(updates[0].error.ok());

  RangeOptions at_old;
  at_old.revision = first->revision;
  auto old = client_->Range(prefix_ + "k", at_old);
  EXPECT_EQ(old.status().code(), Status::Code::kFailedPrecondition) << old.status().ToString();
}

TEST_F(EtcdClientTest, WatchDestructorWaitsForRunningCallbackAndStopsDelivery) {
  std::atomic<bool> in_callback{false};
  std::atomic<int> calls{0};
  auto watch = client_->StartWatch(prefix_, {.prefix = true}, [&](const WatchUpdate&) {
    in_callback = true;
    ++calls;
    std::this_thread::sleep_for(300ms);
    in_callback = false;
  });
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(client_->Put(prefix_ + "a", "1").ok());
  ASSERT_TRUE(WaitUntil([&] { return in_callback.load(); }, 10s));
  watch->reset();
  EXPECT_FALSE(in_callback.load()) << "the callback still ran after the Watch was destroyed";
  const int calls_at_destroy = calls.load();
  ASSERT_TRUE(client_->Put(prefix_ + "b", "2").ok());
  WaitForWitness(prefix_ + "witness");   // under the destroyed watch's prefix too
  EXPECT_EQ(calls.load(), calls_at_destroy);
}

TEST_F(EtcdClientTest, WatchCanBeDestroyedFromItsOwnCallback) {
  std::unique_ptr<Watch> watch;
  std::mutex mu;
  std::atomic<int> calls{0};
  std::lock_guard<std::mutex> hold(mu);  // the callback waits until `watch` is assigned
  auto started = client_->StartWatch(prefix_, {.prefix = true}, [&](const WatchUpdate&) {
    std::lock_guard<std::mutex> lock(mu);
    ++calls;
    watch.reset();
  });
  ASSERT_TRUE(started.ok());
  watch = std::move(*started);
  ASSERT_TRUE(client_->Put(prefix_ + "a", "1").ok());
  ASSERT_TRUE(client_->Put(prefix_ + "b", "2").ok());
  mu.unlock();
  ASSERT_TRUE(WaitUntil([&] { return calls.load() > 0; }, 10s));
  mu.lock();
  mu.unlock();   // the callback that destroyed the watch has returned
  WaitForWitness(prefix_ + "witness");   // b, and the witness's own key, went nowhere else
  mu.lock();
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(watch, nullptr);
}

TEST_F(EtcdClientTest, EmptyKeysAndBadArgumentsAreInvalidArgument) {
  auto expect_invalid = [](const Status& s, const char* what) {
    EXPECT_EQ(s.code(), Status::Code::kInvalidArgument) << what << ": " << s.ToString();
    EXPECT_FALSE(s.message().empty());
  };
  expect_invalid(client_->Put("", "v").status(), "put");
  expect_invalid(client_->Range("").status(), "range");
  expect_invalid(client_->Get("").status(), "get");
  expect_invalid(client_->Delete("", true).status(), "delete prefix");
  expect_invalid(client_->Txn({Compare::KeyMissing("")}, {}).status(), "txn compare");
  expect_invalid(client_->Txn({}, {TxnOp::Put("", "v")}).status(), "txn op");
  expect_invalid(client_->StartWatch("", {}, [](const WatchUpdate&) {}).status(), "watch");
  expect_invalid(client_->StartWatch("k", {}, nullptr).status(), "watch without callback");
  expect_invalid(client_->LeaseGrant(0).status(), "lease ttl");
  RangeOptions negative;
  negative.limit = -1;
  expect_invalid(client_->Range("k", negative).status(), "negative limit");
  EXPECT_NE(client_->Put("", "v").status().message().find("key is empty"), std::string::npos);
}

TEST_F(EtcdClientTest, ChildrenOfForkExecInheritNoEtcdConnectionAndClientKeepsWorking) {
  // Open watch and keep-alive streams, so the client has all its connections and threads.
  auto watch = client_->StartWatch(prefix_, {.prefix = true}, [](const WatchUpdate&) {});
  ASSERT_TRUE(watch.ok());
  auto lease = client_->LeaseGrant(5);
  ASSERT_TRUE(lease.ok());
  auto keeper = client_->KeepAlive(lease->id, [] {});
  ASSERT_TRUE(keeper.ok());
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; !stop; ++i) ASSERT_TRUE(client_->Put(prefix_ + "w", std::to_string(i)).ok());
  });
  for (int i = 0; i < 10; ++i) {
    SpawnOptions spawn;
    // The child lists the sockets it inherited: none may be the parent's.
    spawn.argv = {"/bin/sh", "-c", "ls -l /proc/self/fd | grep -c socket: || true"};
    spawn.stdout_mode = SpawnOptions::Stdio::kPipe;
    auto child = Subprocess::Spawn(spawn);
    ASSERT_TRUE(child.ok()) << child.status().ToString();
    char buf[64] = {};
    ssize_t n = ::read(child->stdout_fd(), buf, sizeof(buf) - 1);
    ASSERT_GT(n, 0);
    EXPECT_EQ(std::string(buf, static_cast<size_t>(n)), "0\n");
    EXPECT_TRUE(WaitStatusSuccess(child->Wait()));
  }
  stop = true;
  writer.join();
  EXPECT_FALSE((*keeper)->lost());
  EXPECT_TRUE(client_->Put(prefix_ + "after", "ok").ok());
}

}  // namespace
}  // namespace efdl::etcd
