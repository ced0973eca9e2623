// bench/spares: pre-started workers forked from the zygote beside spares started as interpreters
// of their own (the baseline), in the same run, with the agent's real SparePool and the default
// imports (torch, torch.distributed, efdl.backend.torch):
//   - replacement: from the activation of a spare until its replacement is ready (imports done,
//     ready byte read), as the agent's loop would see it (Maintain every 10 ms);
//   - memory: the proportional set size (PSS, /proc/PID/smaps_rollup) of each idle spare, and of
//     the zygote, which the forked spares share pages with.
//
// Usage: spares [--nproc N] [--rounds R]   (defaults 2 and 5; run from the repository root or
// with PYTHONPATH holding the efdl package)
#include <fmt/format.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "agent/spare_pool.h"
#include "common/net.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// PSS of `pid` in MiB (0 when unreadable).
double PssMiB(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/smaps_rollup", pid));
  std::string key;
  long kb = 0;
  while (in >> key) {
    if (key == "Pss:") {
      in >> kb;
      return static_cast<double>(kb) / 1024.0;
    }
    in.ignore(1 << 12, '\n');
  }
  return 0;
}

struct Figures {
  std::vector<double> replace_ms;
  double pss_per_spare = 0;
  double pss_zygote = 0;
};

bool Settled(efdl::agent::SparePool& pool, size_t n) {
  pool.Maintain();
  return pool.pids().size() == n && pool.Importing() == 0;
}

bool WaitSettled(efdl::agent::SparePool& pool, size_t n, std::chrono::seconds limit) {
  const auto end = Clock::now() + limit;
  while (!Settled(pool, n)) {
    if (Clock::now() > end || !pool.enabled()) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

int Measure(bool zygote, int nproc, int rounds, const std::string& script,
            const std::map<std::string, std::string>& env, Figures& f) {
  efdl::agent::SparePoolOptions o;
  o.command = {EFDL_PYTHON, "-u", script};
  o.nproc = nproc;
  o.zygote = zygote;
  o.refill_delay = 0ms;   // the baseline at its fastest: no delay before a started refill
  for (int lr = 0; lr < nproc; ++lr) o.start_env[lr] = env;
  auto pool = efdl::agent::SparePool::Create(std::move(o));
  if (!pool.ok()) {
    fmt::print(stderr, "spares: {}\n", pool.status().message());
    return 1;
  }
  auto& p = **pool;
  if (!WaitSettled(p, static_cast<size_t>(nproc), 120s)) {
    fmt::print(stderr, "spares: the {} spares did not get ready\n", zygote ? "forked" : "started");
    return 1;
  }
  for (pid_t pid : p.pids()) f.pss_per_spare += PssMiB(pid) / nproc;
  if (auto z = p.zygote_pid()) f.pss_zygote = PssMiB(*z);
  for (int r = 0; r < rounds; ++r) {
    std::this_thread::sleep_for(500ms);   // idle between events, as between membership changes
    const auto t0 = Clock::now();
    auto worker = p.Activate(0, env, r + 1);
    if (!worker) {
      fmt::print(stderr, "spares: no spare to activate\n");
      return 1;
    }
    if (!WaitSettled(p, static_cast<size_t>(nproc), 120s)) {
      fmt::print(stderr, "spares: no replacement within 120 s\n");
      return 1;
    }
    f.replace_ms.push_back(Ms(Clock::now() - t0));
    (void)worker->Wait();
  }
  return 0;
}

std::string Stats(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return fmt::format("median {:8.1f} ms  max {:8.1f} ms", v[v.size() / 2], v.back());
}

}  // namespace

int main(int argc, char** argv) {
  int nproc = 2, rounds = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--nproc") == 0) nproc = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::max(1, std::atoi(argv[i + 1]));
  }
  // The agent is a child subreaper: the zygote's forks are adopted by it.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    fmt::print(stderr, "spares: PR_SET_CHILD_SUBREAPER: {}\n", std::strerror(errno));
    return 1;
  }
  auto dir = efdl::TempDir::Create("efdl-bench-spares");
  if (!dir.ok()) return 1;
  const std::string script = dir->path() + "/worker.py";
  std::ofstream(script) << "import torch\n";   // the program: what a round's worker would be
  std::map<std::string, std::string> env;
  const char* pp = std::getenv("PYTHONPATH");
  env["PYTHONPATH"] = std::string(EFDL_SOURCE_DIR) + "/python" + (pp ? std::string(":") + pp : "");
  Figures forked, started;
  fmt::print("spares: {} local ranks, {} activations each way (default imports: torch, "
             "torch.distributed, efdl.backend.torch)\n", nproc, rounds);
  if (Measure(true, nproc, rounds, script, env, forked) != 0) return 1;
  if (Measure(false, nproc, rounds, script, env, started) != 0) return 1;
  fmt::print("replacement ready after activation (imports done):\n");
  fmt::print("  forked from the zygote  {}\n", Stats(forked.replace_ms));
  fmt::print("  started (baseline)      {}\n", Stats(started.replace_ms));
  std::sort(forked.replace_ms.begin(), forked.replace_ms.end());
  std::sort(started.replace_ms.begin(), started.replace_ms.end());
  fmt::print("  ratio forked/started (medians) {:.3f}\n",
             forked.replace_ms[forked.replace_ms.size() / 2] /
                 started.replace_ms[started.replace_ms.size() / 2]);
  fmt::print("memory (PSS) of an idle spare:\n");
  fmt::print("  forked  {:7.1f} MiB per spare, + the zygote {:.1f} MiB once per node\n",
             forked.pss_per_spare, forked.pss_zygote);
  fmt::print("  started {:7.1f} MiB per spare (baseline)\n", started.pss_per_spare);
  fmt::print("  ratio forked/started per spare {:.3f}\n",
             forked.pss_per_spare / started.pss_per_spare);
  return 0;
}
