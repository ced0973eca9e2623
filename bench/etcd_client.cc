// bench/etcd_client: our etcd client beside Debian's python3-etcd3 doing the same work against
// the same (embedded) etcd in the same run: sequential puts/s, concurrent puts/s (one client
// shared by N threads) and watch event latency p50/p99 (put one key, wait for its event).
//
// Usage: etcd_client [--quick] [--strict]
//   --quick   fewer operations (a smoke run)
//   --strict  exit 1 when efdl is slower than python3-etcd3 on any figure
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include "common/subprocess.h"
#include "efdl/embedded_etcd.h"
#include "efdl/etcd.h"

namespace {

using Clock = std::chrono::steady_clock;
using efdl::Status;

// One round's work (per client); the benchmark runs several rounds, alternating which client
// goes first, so that both meet the same (shared, noisy) machine.
struct Work {
  int sequential_puts = 500;
  int threads = 8;
  int puts_per_thread = 125;
  int watch_events = 125;
};

struct Figures {
  double sequential = 0;   // puts/s
  double concurrent = 0;   // puts/s
  double watch_p50 = 0;    // ms
  double watch_p99 = 0;    // ms
  std::vector<double> watch_latencies;  // ms, every event
  double cpu_us_per_put = 0;            // the client's own CPU time (user + system) per put
};

// Several rounds' figures as one: throughput over the summed time, latency over every event.
struct Totals {
  double sequential_seconds = 0;
  double concurrent_seconds = 0;
  double cpu_us = 0;
  std::vector<double> watch_latencies;
  void Add(const Figures& f, const Work& w);
  Figures Result(const Work& w, int rounds) const;
};


double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * static_cast<double>(v.size() - 1);
  size_t k = std::min(v.size() - 1, static_cast<size_t>(rank + 0.5));
  return v[k];
}

void Totals::Add(const Figures& f, const Work& w) {
  sequential_seconds += w.sequential_puts / f.sequential;
  concurrent_seconds += w.threads * w.puts_per_thread / f.concurrent;
  cpu_us += f.cpu_us_per_put * (w.sequential_puts + w.threads * w.puts_per_thread);
  watch_latencies.insert(watch_latencies.end(), f.watch_latencies.begin(),
                         f.watch_latencies.end());
}

Figures Totals::Result(const Work& w, int rounds) const {
  Figures f;
  f.sequential = rounds * w.sequential_puts / sequential_seconds;
  f.concurrent = rounds * w.threads * w.puts_per_thread / concurrent_seconds;
  f.watch_p50 = Percentile(watch_latencies, 50);
  f.watch_p99 = Percentile(watch_latencies, 99);
  f.cpu_us_per_put = cpu_us / (rounds * (w.sequential_puts + w.threads * w.puts_per_thread));
  return f;
}

double ProcessCpuMicros() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto us = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_usec);
  };
  return us(u.ru_utime) + us(u.ru_stime);
}

efdl::Result<Figures> RunOurs(const std::string& endpoint, const std::string& prefix,
                              const Work& work) {
  efdl::etcd::ClientOptions options;
  options.endpoints = {endpoint};
  options.call_timeout = std::chrono::seconds(10);
  EFDL_ASSIGN_OR_RETURN(auto client, efdl::etcd::Connect(options));
  const std::string value(64, 'x');
  Figures f;

  const double cpu_start = ProcessCpuMicros();
  auto start = Clock::now();
  for (int i = 0; i < work.sequential_puts; ++i) {
    EFDL_RETURN_IF_ERROR(client->Put(fmt::format("{}seq/{}", prefix, i), value).status());
  }
  f.sequential = work.sequential_puts / Seconds(Clock::now() - start);

  std::atomic<bool> failed{false};
  std::vector<std::thread> pool;
  start = Clock::now();
  for (int t = 0; t < work.threads; ++t) {
    pool.emplace_back([&, t] {
      for (int i = 0; i < work.puts_per_thread && !failed; ++i) {
        if (!client->Put(fmt::format("{}con/{}/{}", prefix, t, i), value).ok()) failed = true;
      }
    });
  }
  for (auto& th : pool) th.join();
  if (failed) return Status::Unavailable("a concurrent put failed");
  f.concurrent = work.threads * work.puts_per_thread / Seconds(Clock::now() - start);
  f.cpu_us_per_put = (ProcessCpuMicros() - cpu_start) /
                     (work.sequential_puts + work.threads * work.puts_per_thread);

  std::mutex mu;
  std::condition_variable cv;
  std::string last_key;
  Clock::time_point received;
  efdl::etcd::WatchOptions watch_options;
  watch_options.prefix = true;
  EFDL_ASSIGN_OR_RETURN(
      auto watch, client->StartWatch(prefix + "watch/", watch_options,
                                     [&](const efdl::etcd::WatchUpdate& u) {
                                       const auto now = Clock::now();
                                       std::lock_guard<std::mutex> lock(mu);
                                       if (!u.events.empty()) {
                                         last_key = u.events.back().kv.key;
                                         received = now;
                                       }
                                       cv.notify_all();
                                     }));
  std::vector<double> latencies;
  for (int i = 0; i < work.watch_events; ++i) {
    const std::string key = fmt::format("{}watch/{}", prefix, i);
    const auto sent = Clock::now();
    EFDL_RETURN_IF_ERROR(client->Put(key, value).status());
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return last_key == key; })) {
      return Status::DeadlineExceeded("no watch event for " + key + " within 10 s");
    }
    latencies.push_back(std::chrono::duration<double, std::milli>(received - sent).count());
  }
  watch.reset();
  f.watch_latencies = std::move(latencies);
  return f;
}

efdl::Result<Figures> RunPython(const std::string& endpoint, const std::string& prefix,
                                const Work& work) {
  efdl::SpawnOptions spawn;
  spawn.argv = {"/usr/bin/python3", EFDL_ETCD_BENCH_PY, endpoint, prefix,
                std::to_string(work.sequential_puts), std::to_string(work.threads),
                std::to_string(work.puts_per_thread), std::to_string(work.watch_events)};
  spawn.stdout_mode = efdl::SpawnOptions::Stdio::kPipe;
  EFDL_ASSIGN_OR_RETURN(auto child, efdl::Subprocess::Spawn(spawn));
  std::string out;
  char buf[4096];
  while (true) {
    ssize_t n = ::read(child.stdout_fd(), buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  int status = child.Wait();
  if (!efdl::WaitStatusSuccess(status)) {
    return Status::Internal("python3-etcd3 side " + efdl::DescribeWaitStatus(status) +
                            " (is python3-etcd3 installed? apt-get install python3-etcd3)");
  }
  auto j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::Internal("python3-etcd3 side printed no JSON: " + out);
  Figures f;
  f.sequential = j.value("sequential_puts_per_s", 0.0);
  f.concurrent = j.value("concurrent_puts_per_s", 0.0);
  f.watch_p50 = j.value("watch_p50_ms", 0.0);
  f.watch_p99 = j.value("watch_p99_ms", 0.0);
  f.watch_latencies = j.value("watch_latencies_ms", std::vector<double>{});
  f.cpu_us_per_put = j.value("cpu_us_per_put", 0.0);
  if (f.sequential <= 0 || f.concurrent <= 0 || f.watch_latencies.empty()) {
    return Status::Internal("python3-etcd3 side printed incomplete figures: " + out);
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  Work work;
  int rounds = 6;
  bool strict = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      work = Work{200, 8, 25, 50};
      rounds = 2;
    } else if (std::strcmp(argv[i], "--strict") == 0) {
      strict = true;
    } else {
      fmt::print(stderr,
                 "etcd_client: unknown argument '{}'; usage: etcd_client [--quick] [--strict]\n",
                 argv[i]);
      return 2;
    }
  }
  // etcd's data on tmpfs where there is one: both clients then wait on etcd's CPU work, not on
  // the shared disk's fsync, so the figures show the clients' own costs.
  if (::access("/dev/shm", W_OK) == 0) ::setenv("TMPDIR", "/dev/shm", 1);
  auto etcd = efdl::EmbeddedEtcd::Start({});
  if (!etcd.ok()) {
    fmt::print(stderr, "etcd_client: {}\n", etcd.status().ToString());
    return 1;
  }
  const std::string endpoint = (*etcd)->endpoint();
  Totals ours_total;
  Totals python_total;
  for (int round = 0; round < rounds; ++round) {
    // Each client on its own key prefix per round; the etcd is the same.
    for (int side = 0; side < 2; ++side) {
      const bool python_now = (side + round) % 2 == 0;
      const std::string prefix =
          fmt::format("/bench/{}/{}/", python_now ? "py" : "efdl", round);
      auto figures =
          python_now ? RunPython(endpoint, prefix, work) : RunOurs(endpoint, prefix, work);
      if (!figures.ok()) {
        fmt::print(stderr, "etcd_client: {}\n", figures.status().ToString());
        return 1;
      }
      (python_now ? python_total : ours_total).Add(*figures, work);
    }
  }
  const Figures ours_f = ours_total.Result(work, rounds);
  const Figures python_f = python_total.Result(work, rounds);
  const Figures* ours = &ours_f;
  const Figures* python = &python_f;
  fmt::print("etcd client benchmark, etcd {} on loopback (same etcd, same run)\n", endpoint);
  fmt::print("work per client: {} rounds (alternating who goes first) of {} sequential puts, "
             "{} threads x {} puts, {} watch events; 64-byte values\n",
             rounds, work.sequential_puts, work.threads, work.puts_per_thread, work.watch_events);
  fmt::print("{:<30} {:>12} {:>15} {:>8}\n", "figure", "efdl (C++)", "python3-etcd3",
             "ratio");
  std::vector<std::string> slower;
  auto row = [&](const char* name, double ours_v, double py_v, bool higher_is_better) {
    // Ratio > 1: efdl is better.
    double ratio = higher_is_better ? ours_v / py_v : py_v / ours_v;
    fmt::print("{:<30} {:>12.2f} {:>15.2f} {:>7.2f}x\n", name, ours_v, py_v, ratio);
    if (ratio < 1.0) slower.push_back(name);
  };
  row("sequential puts/s", ours->sequential, python->sequential, true);
  row(fmt::format("concurrent puts/s ({} threads)", work.threads).c_str(), ours->concurrent,
      python->concurrent, true);
  row("watch latency p50 (ms)", ours->watch_p50, python->watch_p50, false);
  row("watch latency p99 (ms)", ours->watch_p99, python->watch_p99, false);
  row("client CPU per put (us)", ours->cpu_us_per_put, python->cpu_us_per_put, false);
  fmt::print("ratio: how many times better efdl is (throughput ours/python, latency and CPU "
             "python/ours)\n");
  if (slower.empty()) {
    fmt::print("verdict: efdl is at least as fast as python3-etcd3 on every figure\n");
    return 0;
  }
  std::string names;
  for (const auto& s : slower) names += (names.empty() ? "" : ", ") + s;
  fmt::print("verdict: efdl is SLOWER on: {}\n", names);
  return strict ? 1 : 0;
}
