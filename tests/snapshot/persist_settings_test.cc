// The persistence settings (snapshot/persist_settings.h), read through an injected environment:
// defaults, the integer and on-word rules, and the one-line refusals the agent and state.py show.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "snapshot/persist_settings.h"

namespace efdl::snapshot {
namespace {

using namespace std::chrono_literals;

class PersistSettingsTest : public ::testing::Test {
 protected:
  Result<PersistSettings> Read(std::map<std::string, std::string> vars,
                               std::string secret = "secret") {
    vars_ = std::move(vars);
    return PersistSettingsFromEnvironment(
        [this](const char* name) -> const char* {
          auto it = vars_.find(name);
          return it == vars_.end() ? nullptr : it->second.c_str();
        },
        std::move(secret));
  }
  // The message of a refused setting (empty when it was accepted).
  std::string Refusal(std::map<std::string, std::string> vars, std::string secret = "secret") {
    auto r = Read(std::move(vars), std::move(secret));
    if (r.ok()) return "";
    EXPECT_EQ(r.status().code(), Status::Code::kInvalidArgument);
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos);
    return r.status().message();
  }

 private:
  std::map<std::string, std::string> vars_;
};

TEST_F(PersistSettingsTest, DefaultsWhenUnsetOrBlank) {
  for (const char* blank : {"", " ", "\t \n"}) {
    auto r = Read({{"EFDL_SNAPSHOT_PER_RANK", blank}, {"EFDL_SNAPSHOT_KEEP", blank},
                   {"EFDL_PERSIST_MIN_INTERVAL_MS", blank}, {"EFDL_SNAPSHOT_HMAC", blank}});
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_FALSE(r->per_rank);
    EXPECT_EQ(r->keep, 2);
    EXPECT_EQ(r->min_interval, 1000ms);
    EXPECT_EQ(r->hmac_key, "");
  }
  auto r = Read({});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->keep, 2);
  EXPECT_EQ(r->min_interval, 1000ms);
}

TEST_F(PersistSettingsTest, Integers) {
  struct Case {
    const char* value;
    int64_t want;
  };
  for (const Case& c : {Case{"3", 3}, Case{" 7 ", 7}, Case{"+4", 4}, Case{"007", 7},
                        Case{"2000000", 1 << 20}}) {
    auto r = Read({{"EFDL_SNAPSHOT_KEEP", c.value}});
    ASSERT_TRUE(r.ok()) << c.value << ": " << r.status().message();
    EXPECT_EQ(r->keep, c.want) << c.value;
  }
  auto r = Read({{"EFDL_SNAPSHOT_PER_RANK", "-1"}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "-5"}});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->per_rank);                  // an integer flag: not 0 is on
  EXPECT_EQ(r->min_interval, 0ms);           // negative: no limit
  r = Read({{"EFDL_SNAPSHOT_PER_RANK", "0"}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "99999999999999"}});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->per_rank);
  EXPECT_EQ(r->min_interval, std::chrono::milliseconds(int64_t{365} * 24 * 3600 * 1000));
}

TEST_F(PersistSettingsTest, NotAnIntegerNamesTheVariable) {
  for (const char* bad : {"two", "1.5", "0x10", "1_000", "+-3", "++3", "+", "-", "3 4", "1e3"}) {
    EXPECT_EQ(Refusal({{"EFDL_SNAPSHOT_KEEP", bad}}),
              std::string("environment variable EFDL_SNAPSHOT_KEEP='") + bad +
                  "' is not an integer; set it to a whole number or unset it");
  }
  EXPECT_NE(Refusal({{"EFDL_SNAPSHOT_PER_RANK", "yes"}})
                .find("environment variable EFDL_SNAPSHOT_PER_RANK='yes' is not an integer"),
            std::string::npos);
  EXPECT_NE(Refusal({{"EFDL_PERSIST_MIN_INTERVAL_MS", " 1s "}})
                .find("EFDL_PERSIST_MIN_INTERVAL_MS='1s' is not an integer"),
            std::string::npos);
  EXPECT_NE(Refusal({{"EFDL_PERSIST_MIN_INTERVAL_MS", "99999999999999999999"}})
                .find("EFDL_PERSIST_MIN_INTERVAL_MS='99999999999999999999' is out of range"),
            std::string::npos);
}

TEST_F(PersistSettingsTest, KeepMustKeepOne) {
  EXPECT_EQ(Refusal({{"EFDL_SNAPSHOT_KEEP", "0"}}),
            "EFDL_SNAPSHOT_KEEP=0 keeps no snapshot; set it to 1 or more");
  EXPECT_EQ(Refusal({{"EFDL_SNAPSHOT_KEEP", "-2"}}),
            "EFDL_SNAPSHOT_KEEP=-2 keeps no snapshot; set it to 1 or more");
  EXPECT_EQ(Refusal({{"EFDL_SNAPSHOT_KEEP", "1"}}), "");
}

TEST_F(PersistSettingsTest, HmacOnWordsTakeTheSecret) {
  for (const char* on : {"1", "true", "yes", "on", " On ", "TRUE", "Yes\n"}) {
    auto r = Read({{"EFDL_SNAPSHOT_HMAC", on}}, "the-secret");
    ASSERT_TRUE(r.ok()) << on;
    EXPECT_EQ(r->hmac_key, "the-secret") << on;
  }
  for (const char* off : {"0", "false", "no", "off", "2", "enabled", "o n"}) {
    auto r = Read({{"EFDL_SNAPSHOT_HMAC", off}}, "the-secret");
    ASSERT_TRUE(r.ok()) << off;
    EXPECT_EQ(r->hmac_key, "") << off;
  }
  // Off needs no secret; on without one is refused.
  EXPECT_EQ(Refusal({{"EFDL_SNAPSHOT_HMAC", "0"}}, ""), "");
  const std::string refusal = Refusal({{"EFDL_SNAPSHOT_HMAC", "yes"}}, "");
  EXPECT_EQ(refusal.rfind("EFDL_SNAPSHOT_HMAC=1 needs the job's secret", 0), 0u) << refusal;
  EXPECT_NE(refusal.find("unset EFDL_SNAPSHOT_HMAC"), std::string::npos) << refusal;
}

TEST_F(PersistSettingsTest, FirstRefusalInAFixedOrder) {
  // per-rank, keep, interval, hmac: the same variable is named whoever reads them.
  EXPECT_NE(Refusal({{"EFDL_SNAPSHOT_PER_RANK", "x"}, {"EFDL_SNAPSHOT_KEEP", "x"}})
                .find("EFDL_SNAPSHOT_PER_RANK"),
            std::string::npos);
  EXPECT_NE(Refusal({{"EFDL_SNAPSHOT_KEEP", "0"}, {"EFDL_PERSIST_MIN_INTERVAL_MS", "x"}})
                .find("EFDL_SNAPSHOT_KEEP"),
            std::string::npos);
}

}  // namespace
}  // namespace efdl::snapshot
