// Values under /efdl/<job>/ written by something other than an agent: every decoder answers
// with a Corruption status (never an exception or a silent wrap), and its message stays short
// whatever the value's size.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "rendezvous/protocol.h"

namespace efdl::rdzv {
namespace {

// Inputs every record decoder must refuse.
const std::vector<std::string>& Garbage() {
  static const std::vector<std::string> inputs = {
      "",                          // empty value
      "not json",                  // not JSON
      "{\"r\":1",                  // truncated JSON
      "[1,2,3]",                   // JSON, not an object
      "42",                        // a bare number
      "\"text\"",                  // a bare string
      "{\"r\":\"1\"}",             // string where a number belongs
      "{\"r\":1.5}",               // float where an integer belongs
      "{\"r\":true}",              // bool where an integer belongs
      "{\"r\":1e400}",             // a number no double holds
  };
  return inputs;
}

template <class Record>
void ExpectRejected(const std::string& text) {
  auto r = Record::Decode(text);
  ASSERT_FALSE(r.ok()) << text;
  EXPECT_EQ(r.status().code(), Status::Code::kCorruption) << text;
}

TEST(RecordsBadInputTest, EveryDecoderRefusesGarbageWithACorruptionStatus) {
  for (const auto& text : Garbage()) {
    ExpectRejected<RoundRecord>(text);
    ExpectRejected<AssignRecord>(text);
    ExpectRejected<AckRecord>(text);
  }
  ExpectRejected<NodeRecord>("not json");
  ExpectRejected<NodeRecord>(R"({"addr":7})");
  ExpectRejected<NodeRecord>(R"({"addr":"h","nproc":"4"})");
}

TEST(RecordsBadInputTest, ArraysOfTheWrongElementTypeAreRefusedNotThrown) {
  ExpectRejected<RoundRecord>(R"({"r":1,"ph":"active","c":"n1","d":[1,2]})");
  ExpectRejected<RoundRecord>(R"({"r":1,"ph":"active","c":"n1","d":["n2",null]})");
  ExpectRejected<RoundRecord>(R"({"r":1,"ph":"active","c":"n1","d":"n2"})");
}

TEST(RecordsBadInputTest, OutOfRangeIntegersAreRefusedNotWrapped) {
  ExpectRejected<RoundRecord>(R"({"r":1,"ph":"active","c":"n1","mp":70000})");
  ExpectRejected<RoundRecord>(R"({"r":1,"ph":"active","c":"n1","mp":-1})");
  ExpectRejected<RoundRecord>(R"({"r":18446744073709551615,"ph":"active","c":"n1"})");
  ExpectRejected<AckRecord>(R"({"r":1,"st":"ack","port":65536})");
  ExpectRejected<AssignRecord>(R"({"r":1,"rank":4294967296})");
  ExpectRejected<NodeRecord>(R"({"addr":"h","nproc":-2147483649})");
  // The edges themselves are fine.
  auto ack = AckRecord::Decode(R"({"r":9223372036854775807,"st":"ack","port":65535})");
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  EXPECT_EQ(ack->port, 65535);
}

TEST(RecordsBadInputTest, AHugeValueGivesAShortErrorMessage) {
  std::string huge = "{\"r\":\"" + std::string(1 << 20, 'x') + "\"}";
  auto r = RoundRecord::Decode(huge);
  ASSERT_FALSE(r.ok());
  EXPECT_LT(r.status().ToString().size(), 400u);
  EXPECT_NE(r.status().ToString().find("bytes"), std::string::npos) << r.status().ToString();
}

TEST(RecordsBadInputTest, StatusRecordSkipsBadEntriesAndKeepsGoodOnes) {
  auto st = StatusRecord::Decode(R"({
      "members": [{"id":"n1","addr":"h1","nproc":2,"rank":0}, 5, {"id":7},
                  {"id":"n2","rank":"one"}, {"id":"n3","addr":"h3","nproc":1,"rank":1}],
      "standbys": ["n4", 3, null],
      "events": [{"time":"t1","message":"m1"}, "x", {"time":1}]})");
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  ASSERT_EQ(st->members.size(), 2u);
  EXPECT_EQ(st->members[0].id, "n1");
  EXPECT_EQ(st->members[1].id, "n3");
  EXPECT_EQ(st->members[1].rank, 1);
  EXPECT_EQ(st->standbys, std::vector<std::string>{"n4"});
  ASSERT_EQ(st->events.size(), 1u);
  EXPECT_EQ(st->events[0].message, "m1");
  // Lists of the wrong type read as empty; a value that is not an object is an error.
  auto odd = StatusRecord::Decode(R"({"members":{"id":"n1"},"standbys":"n4","events":7})");
  ASSERT_TRUE(odd.ok());
  EXPECT_TRUE(odd->members.empty() && odd->standbys.empty() && odd->events.empty());
  EXPECT_FALSE(StatusRecord::Decode("[]").ok());
  EXPECT_FALSE(StatusRecord::Decode("{").ok());
}

}  // namespace
}  // namespace efdl::rdzv
