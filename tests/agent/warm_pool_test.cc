// WarmPool alone (issue #31 step 1; docs/agent.md): real spares of a real python program, the
// agent store in one of them (torch's TCPStore server, python/efdl/_agent_store.py), and a
// rendezvous double that records what the pool tells it; no Agent.
#include "agent/warm_pool.h"

#include <signal.h>

#include <chrono>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/net.h"
#include "queued_rendezvous.h"
#include "test_util.h"
#include "../support/temp_dir_test.h"

namespace efdl::agent {
namespace {

using namespace std::chrono_literals;
using testing::WaitUntil;

// Records the pool's two calls.
class PoolRendezvous : public testing::QueuedRendezvous {
 public:
  void OfferAgentStore(uint16_t port) override {
    std::lock_guard lock(mu_);
    offers.push_back(port);
  }
  void NoteNoPrestart(const std::string& why) override {
    std::lock_guard lock(mu_);
    notes.push_back(why);
  }
  std::vector<uint16_t> Offers() {
    std::lock_guard lock(mu_);
    return offers;
  }
  std::vector<std::string> Notes() {
    std::lock_guard lock(mu_);
    return notes;
  }

 private:
  std::mutex mu_;
  std::vector<uint16_t> offers;
  std::vector<std::string> notes;
};

class WarmPoolTest : public TempDirTest {
 protected:
  WarmPoolTest() : TempDirTest("efdl-warm-pool-test") {}
  void SetUpInDir() override { std::ofstream(dir_.path() + "/prog.py") << "pass\n"; }
  // One spare of prog.py, an interpreter of its own (no zygote: no subreaper needed), with
  // `env` added to its start environment.
  SparePoolOptions Options(std::map<std::string, std::string> env = {}) {
    SparePoolOptions o;
    o.command = {EFDL_PYTHON, "-u", dir_.path() + "/prog.py"};
    o.nproc = 1;
    o.zygote = false;
    o.refill_delay = 0ms;
    env["PYTHONPATH"] = std::string(EFDL_SOURCE_DIR) + "/python";
    env["EFDL_PRELOAD_MODULES"] = "";
    o.start_env[0] = std::move(env);
    return o;
  }

  PoolRendezvous rdzv_;
};

TEST_F(WarmPoolTest, TheAgentStoreRunsInASpareAndItsPortIsOfferedUntilItDies) {
  WarmPool pool(rdzv_);
  pool.Start(Options());
  ASSERT_NE(pool.spares(), nullptr);
  EXPECT_EQ(pool.WarmUp([] { return 0; }), 0);
  ASSERT_EQ(rdzv_.Offers().size(), 1u) << "the store's port is offered once it listens";
  EXPECT_NE(rdzv_.Offers()[0], 0);
  ASSERT_GT(pool.store_pid(), 0);
  EXPECT_TRUE(rdzv_.Notes().empty()) << "the pool is on";
  // The store dies: rounds led here no longer use it.
  ::kill(pool.store_pid(), SIGKILL);
  EXPECT_TRUE(WaitUntil([&] {
    pool.Maintain();
    return rdzv_.Offers().size() == 2;
  }, 10s));
  EXPECT_EQ(rdzv_.Offers().back(), 0);
  EXPECT_EQ(pool.store_pid(), 0);
}

TEST_F(WarmPoolTest, APoolThatTurnsItselfOffIsToldOnce) {
  WarmPool pool(rdzv_);
  // Its spares cannot start an interpreter: the pool turns itself off.
  pool.Start(Options({{"PYTHONHOME", dir_.path() + "/no-such-home"}}));
  ASSERT_NE(pool.spares(), nullptr);
  EXPECT_TRUE(WaitUntil([&] {
    pool.Maintain();
    return !rdzv_.Notes().empty();
  }, 30s));
  for (int i = 0; i < 5; ++i) pool.Maintain();
  ASSERT_EQ(rdzv_.Notes().size(), 1u);
  EXPECT_EQ(rdzv_.Notes()[0], pool.spares()->off_reason());
  EXPECT_TRUE(rdzv_.Offers().empty());
  pool.Stop();
  EXPECT_EQ(pool.spares(), nullptr);
}

}  // namespace
}  // namespace efdl::agent
