// DriverPool (issue #37): many nodes' driver steps on a few threads, each node's never on two
// at once, woken again when woken while running, at its deadline, and never after Close.
#include "rendezvous/driver_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

namespace efdl::rdzv {
namespace {

using namespace std::chrono_literals;

TEST(DriverPoolTest, AStrandNeverRunsOnTwoThreadsAndRunsAgainWhenWokenWhileRunning) {
  DriverPool pool(4);
  std::atomic<int> inside{0}, overlap{0}, runs{0};
  auto strand = pool.NewStrand([&]() -> std::optional<DriverPool::TimePoint> {
    if (inside.fetch_add(1) != 0) overlap.fetch_add(1);
    std::this_thread::sleep_for(1ms);
    inside.fetch_sub(1);
    runs.fetch_add(1);
    return std::nullopt;
  });
  std::vector<std::thread> wakers;
  for (int t = 0; t < 4; ++t) {
    wakers.emplace_back([&] {
      for (int i = 0; i < 50; ++i) pool.Wake(strand);
    });
  }
  for (auto& t : wakers) t.join();
  const int before = runs.load();
  pool.Wake(strand);   // after every other wake: must run once more
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (runs.load() <= before && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  pool.Close(strand);
  EXPECT_EQ(overlap.load(), 0);
  EXPECT_GT(runs.load(), before);
  EXPECT_LE(runs.load(), 201);
}

TEST(DriverPoolTest, AWakeWhileTheStepRunsRunsItOnceMore) {
  DriverPool pool(2);
  std::atomic<int> runs{0};
  std::atomic<bool> entered{false}, release{false};
  auto strand = pool.NewStrand([&]() -> std::optional<DriverPool::TimePoint> {
    if (runs.fetch_add(1) == 0) {
      entered = true;
      while (!release) std::this_thread::sleep_for(1ms);
    }
    return std::nullopt;
  });
  pool.Wake(strand);
  while (!entered) std::this_thread::sleep_for(1ms);
  pool.Wake(strand);   // an input queued while the node is busy with the previous batch
  release = true;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (runs.load() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  pool.Close(strand);
  EXPECT_EQ(runs.load(), 2);
}

TEST(DriverPoolTest, ManyStrandsRunAtTheirDeadlinesAndNotAfterClose) {
  DriverPool pool(2);
  constexpr int kStrands = 2000;
  std::vector<std::atomic<int>> runs(kStrands);
  std::vector<std::shared_ptr<DriverPool::Strand>> strands;
  const auto start = DriverPool::Clock::now();
  for (int i = 0; i < kStrands; ++i) {
    strands.push_back(pool.NewStrand([&, i]() -> std::optional<DriverPool::TimePoint> {
      // First run: ask for one more 50 ms later; then nothing.
      if (runs[static_cast<size_t>(i)].fetch_add(1) == 0) return start + 50ms;
      return std::nullopt;
    }));
    pool.Wake(strands.back());
  }
  auto deadline = start + 10s;
  auto all_twice = [&] {
    for (auto& r : runs) {
      if (r.load() < 2) return false;
    }
    return true;
  };
  while (!all_twice() && DriverPool::Clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(all_twice());
  EXPECT_GE(DriverPool::Clock::now() - start, 50ms);
  for (auto& s : strands) pool.Close(s);
  for (auto& s : strands) pool.Wake(s);
  std::this_thread::sleep_for(50ms);
  for (auto& r : runs) EXPECT_EQ(r.load(), 2);
}

}  // namespace
}  // namespace efdl::rdzv
