// The status record in pages (issue #37): above a page's worth of members and standbys the
// coordinator writes P status/00000.. and `efdl status` (ReadJobStatus) puts them together.
#include "rendezvous/status_pages.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "rendezvous/job_status.h"
#include "support/memory_etcd.h"

namespace efdl::rdzv {
namespace {

using nlohmann::json;

json Record(int members, int standbys) {
  json m = json::array(), s = json::array();
  for (int i = 0; i < members; ++i) {
    m.push_back({{"id", "m" + std::to_string(i)}, {"rank", i}, {"addr", "h"}, {"nproc", 1}});
  }
  for (int i = 0; i < standbys; ++i) s.push_back("s" + std::to_string(i));
  return {{"round", 3}, {"coordinator", "m0"}, {"members", m}, {"standbys", s},
          {"events", json::array({{{"time", "t"}, {"message", "round 3 formed"}}})}};
}

TEST(StatusPagesTest, ARecordOverAPageIsSplitAndReadBackWhole) {
  testing::MemoryEtcd db;
  const JobKeys keys("big");
  RoundRecord round;
  round.round = 3;
  round.phase = Phase::kActive;
  round.coordinator = "m0";
  ASSERT_TRUE(db.Put(keys.round, round.Encode()).ok());
  // Nodes m0..m6 and s0, s1 are registered, so the status shows them as members / standbys.
  for (int i = 0; i < 7; ++i) {
    ASSERT_TRUE(db.Put(keys.Node("m" + std::to_string(i)), NodeRecord{"h", 1, "", ""}.Encode()).ok());
  }
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(db.Put(keys.Node("s" + std::to_string(i)), NodeRecord{"h", 1, "", ""}.Encode()).ok());
  }
  auto written = PutStatusRecord(db, keys, Record(7, 2), 3);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  auto header = db.Get(keys.status);
  ASSERT_TRUE(header.ok() && header->has_value());
  json h = json::parse((*header)->value);
  EXPECT_EQ(h["pages"], 3);
  EXPECT_TRUE(h["members"].empty());
  auto pages = db.Range(StatusPagePrefix(keys), {.prefix = true});
  ASSERT_TRUE(pages.ok());
  ASSERT_EQ(pages->kvs.size(), 3u);
  EXPECT_EQ(pages->kvs[0].key, StatusPageKey(keys, 0));

  auto st = ReadJobStatus(db, "big");
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  ASSERT_EQ(st->members.size(), 7u);
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(st->members[static_cast<size_t>(i)].id, "m" + std::to_string(i));
    EXPECT_EQ(st->members[static_cast<size_t>(i)].state, "member");
  }
  ASSERT_EQ(st->standbys.size(), 2u);
  EXPECT_TRUE(st->waiting.empty());
  ASSERT_EQ(st->events.size(), 1u);

  // A smaller record later: one key again, and the old pages are gone.
  ASSERT_TRUE(PutStatusRecord(db, keys, Record(2, 0), 3).ok());
  pages = db.Range(StatusPagePrefix(keys), {.prefix = true});
  ASSERT_TRUE(pages.ok());
  EXPECT_TRUE(pages->kvs.empty());
  st = ReadJobStatus(db, "big");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->members.size(), 2u);
}

TEST(StatusPagesTest, APageOfAnotherWriteIsSkipped) {
  json header = {{"round", 1}, {"members", json::array()}, {"standbys", json::array()},
                 {"pages", 2}, {"seq", 7}};
  std::vector<etcd::KeyValue> pages(2);
  pages[0].value =
      json{{"seq", 7}, {"members", {{{"id", "a"}}}}, {"standbys", json::array()}}.dump();
  pages[1].value = json{{"seq", 6}, {"members", {{{"id", "old"}}}}, {"standbys", {"x"}}}.dump();
  json joined = json::parse(JoinStatusPages(header.dump(), pages));
  ASSERT_EQ(joined["members"].size(), 1u);
  EXPECT_EQ(joined["members"][0]["id"], "a");
  EXPECT_TRUE(joined["standbys"].empty());
  EXPECT_FALSE(joined.contains("pages"));
  // A record without pages (every job below kStatusPageEntries nodes) is read as it is.
  const std::string plain = Record(2, 1).dump();
  EXPECT_EQ(JoinStatusPages(plain, {}), plain);
}

}  // namespace
}  // namespace efdl::rdzv
