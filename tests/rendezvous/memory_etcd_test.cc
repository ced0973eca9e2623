// The fake must behave like etcd where the rendezvous relies on it, or its tests prove nothing.
#include "support/memory_etcd.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>

namespace efdl::testing {
namespace {

using namespace std::chrono_literals;

TEST(MemoryEtcdTest, RevisionsAndVersionsFollowEtcd) {
  MemoryEtcd db;
  auto p1 = db.Put("/a", "1");
  auto p2 = db.Put("/a", "2");
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_EQ(p2->revision, p1->revision + 1);
  auto kv = db.Get("/a");
  ASSERT_TRUE(kv.ok() && kv->has_value());
  EXPECT_EQ((*kv)->create_revision, p1->revision);
  EXPECT_EQ((*kv)->mod_revision, p2->revision);
  EXPECT_EQ((*kv)->version, 2);
  auto del = db.Delete("/a");
  ASSERT_TRUE(del.ok());
  EXPECT_EQ(del->deleted, 1);
  auto none = db.Delete("/a");
  EXPECT_EQ(none->revision, del->revision);  // deleting nothing does not bump the revision
}

TEST(MemoryEtcdTest, PrefixRangeSortsAndFiltersByCreateRevision) {
  MemoryEtcd db;
  ASSERT_TRUE(db.Put("/p/b", "x").ok());
  ASSERT_TRUE(db.Put("/p/a", "y").ok());
  ASSERT_TRUE(db.Put("/q", "z").ok());
  etcd::RangeOptions o;
  o.prefix = true;
  auto r = db.Range("/p/", o);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->kvs.size(), 2u);
  EXPECT_EQ(r->kvs[0].key, "/p/a");  // key order by default
  o.sort_order = etcd::RangeOptions::SortOrder::kAscend;
  o.sort_target = etcd::RangeOptions::SortTarget::kCreateRevision;
  r = db.Range("/p/", o);
  EXPECT_EQ(r->kvs[0].key, "/p/b");
  o.max_create_revision = r->kvs[0].create_revision;
  r = db.Range("/p/", o);
  ASSERT_EQ(r->kvs.size(), 1u);
  EXPECT_EQ(r->kvs[0].key, "/p/b");
}

TEST(MemoryEtcdTest, TxnCompareSelectsBranchAndSharesOneRevision) {
  MemoryEtcd db;
  auto t = db.Txn({etcd::Compare::KeyMissing("/k")},
                  {etcd::TxnOp::Put("/k", "1"), etcd::TxnOp::Put("/j", "2")},
                  {etcd::TxnOp::Get("/k")});
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->succeeded);
  auto k = db.Get("/k");
  auto j = db.Get("/j");
  EXPECT_EQ((*k)->mod_revision, (*j)->mod_revision);
  t = db.Txn({etcd::Compare::KeyMissing("/k")}, {etcd::TxnOp::Put("/k", "3")},
             {etcd::TxnOp::Get("/k")});
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->succeeded);
  ASSERT_EQ(t->gets.size(), 1u);
  EXPECT_EQ(t->gets[0].kvs[0].value, "1");
  // A mod-revision guard fails once someone else wrote.
  int64_t seen = (*k)->mod_revision;
  ASSERT_TRUE(db.Put("/k", "4").ok());
  t = db.Txn({etcd::Compare::ModRevisionIs("/k", seen)}, {etcd::TxnOp::Put("/k", "5")});
  EXPECT_FALSE(t->succeeded);
  std::vector<etcd::TxnOp> many(129, etcd::TxnOp::Put("/m", "x"));
  EXPECT_FALSE(db.Txn({}, many).ok());  // etcd's --max-txn-ops default
}

TEST(MemoryEtcdTest, LeaseExpiryDeletesKeysAndTellsKeeper) {
  auto now = std::chrono::steady_clock::now();
  std::atomic<int64_t> offset_s{0};
  MemoryEtcd db([&] { return now + std::chrono::seconds(offset_s.load()); });
  auto lease = db.LeaseGrant(5);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(db.Put("/l", "v", lease->id).ok());
  std::atomic<bool> lost{false};
  auto keeper = db.KeepAlive(lease->id, [&] { lost = true; });
  ASSERT_TRUE(keeper.ok());
  offset_s = 100;  // a kept lease survives any time
  db.ExpireDueLeases();
  EXPECT_TRUE((*db.Get("/l")).has_value());
  db.PauseKeepAlive(lease->id, true);
  offset_s = 104;
  db.ExpireDueLeases();
  EXPECT_TRUE((*db.Get("/l")).has_value());
  offset_s = 106;
  db.ExpireDueLeases();
  EXPECT_FALSE((*db.Get("/l")).has_value());
  ASSERT_TRUE(db.WaitIdle(2s));
  EXPECT_TRUE(lost.load());
  EXPECT_TRUE((*keeper)->lost());
  EXPECT_FALSE(db.Put("/l", "v", lease->id).ok());
}

TEST(MemoryEtcdTest, WatchReplaysFromRevisionInOrderAndStopsWhenDestroyed) {
  MemoryEtcd db;
  auto first = db.Put("/w/1", "a");
  ASSERT_TRUE(db.Put("/w/2", "b").ok());
  std::mutex mu;
  std::vector<std::string> seen;
  auto w = db.StartWatch("/w/", {true, first->revision, false}, [&](const etcd::WatchUpdate& u) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& e : u.events) {
      seen.push_back((e.type == etcd::WatchEvent::Type::kPut ? "put " : "del ") + e.kv.key);
    }
  });
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(db.Delete("/w/1").ok());
  ASSERT_TRUE(db.Put("/x", "other").ok());
  ASSERT_TRUE(db.WaitIdle(2s));
  w->reset();
  ASSERT_TRUE(db.Put("/w/3", "late").ok());
  ASSERT_TRUE(db.WaitIdle(2s));
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(seen, (std::vector<std::string>{"put /w/1", "put /w/2", "del /w/1"}));
}

TEST(MemoryEtcdTest, WatchFromCompactedRevisionReportsCompaction) {
  MemoryEtcd db;
  auto p = db.Put("/c", "1");
  ASSERT_TRUE(db.Put("/c", "2").ok());
  ASSERT_TRUE(db.Compact(p->revision + 1).ok());
  std::atomic<bool> compacted{false};
  auto w = db.StartWatch("/c", {false, p->revision, false},
                         [&](const etcd::WatchUpdate& u) { compacted = u.compacted; });
  ASSERT_TRUE(db.WaitIdle(2s));
  EXPECT_TRUE(compacted.load());
}

}  // namespace
}  // namespace efdl::testing
