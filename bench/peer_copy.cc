// bench/peer_copy: what the peer copy (issue #35 part 2, src/agent/peer_copy.h) costs, with the
// agent's real PeerCopy: two rooms on loopback TCP, as two agents. Node "a" writes rank 1's
// per-rank arena through a SnapshotEngine (3 slots, in /dev/shm, as a worker does); its PeerCopy
// sends each commit to node "b", whose PeerCopy keeps it in its 2-slot peer arena in /dev/shm.
//
// Per rep: the source changes, State-like Commit() (timed), then the time until b has installed
// that commit (its PeerCopy's received count): the sender's poll (1 ms here; 100 ms in the agent,
// where a mark is also at most once per EFDL_PERSIST_MIN_INTERVAL_MS), its copy of the slot into
// its buffer, the checksum (computed by the sender when the slot has none), the handshake, the
// transfer over loopback TCP, the receiver's writes into its arena and its checksum check. A
// raw copy of the same bytes (one thread, into pre-faulted memory) is timed right before.
// Then the bytes each side holds in /dev/shm (blocks allocated, st_blocks), and b's copy is
// restored and compared with the source.
//
// Prints a table and one line `PEERCOPY {json}` (bench/snapshot.py --footprint reads it).
// Usage: peer_copy [--bytes N] [--tensors T] [--reps R]   (defaults 1 GiB, 32, 3)
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent/peer_copy.h"
#include "efdl/snapshot.h"
#include "snapshot/arena_dir.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using efdl::agent::PeerCopy;

constexpr const char* kJob = "bench-peer-copy";
constexpr const char* kSecret =
    "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

uint64_t Blocks(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : 0;
}

// A directory of /dev/shm of its own (removed with what is in it).
struct ShmDir {
  std::string path;
  ShmDir() {
    std::string tmpl = "/dev/shm/efdl-bench-pc-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      fmt::print(stderr, "peer_copy: cannot make a directory in /dev/shm: {}\n",
                 std::strerror(errno));
      std::exit(1);
    }
    path = tmpl;
  }
  ~ShmDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

std::unique_ptr<PeerCopy> Room(const ShmDir& dir, const std::string& holder) {
  efdl::agent::PeerCopyOptions o;
  o.job_id = kJob;
  o.holder = holder;
  o.shm_dir = dir.path;
  o.secret = kSecret;
  o.listen_addr = "127.0.0.1";
  o.min_interval = 0ms;   // every commit is a mark
  o.poll_interval = 1ms;
  o.io_timeout = 60000ms;
  auto pc = PeerCopy::Start(o);
  if (!pc.ok()) {
    fmt::print(stderr, "peer_copy: {}\n", pc.status().ToString());
    std::exit(1);
  }
  return std::move(pc).value();
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t bytes = uint64_t{1} << 30;
  int tensors = 32;
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--bytes") {
      bytes = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--tensors") {
      tensors = std::atoi(argv[i + 1]);
    } else if (flag == "--reps") {
      reps = std::atoi(argv[i + 1]);
    } else {
      fmt::print(stderr, "usage: peer_copy [--bytes N] [--tensors T] [--reps R]\n");
      return 2;
    }
  }
  tensors = std::max(tensors, 1);
  const uint64_t per = std::max<uint64_t>(bytes / static_cast<uint64_t>(tensors) / 4, 1) * 4;
  bytes = per * static_cast<uint64_t>(tensors);

  ShmDir shm_a;
  ShmDir shm_b;
  auto a = Room(shm_a, "hosta.0");
  auto b = Room(shm_b, "hostb.0");

  efdl::snapshot::EngineOptions eo;
  eo.job_id = kJob;
  eo.scope = "rank1";
  eo.arena_path = efdl::snapshot::ArenaPath(shm_a.path, kJob, "hosta.0", "rank1");
  eo.persist = false;
  auto opened = efdl::snapshot::SnapshotEngine::Open(eo);
  if (!opened.ok()) {
    fmt::print(stderr, "peer_copy: {}\n", opened.status().ToString());
    return 1;
  }
  auto engine = std::move(opened).value();
  std::vector<efdl::snapshot::TensorEntry> layout;
  std::vector<std::vector<uint8_t>> data(static_cast<size_t>(tensors));
  std::vector<efdl::snapshot::TensorSource> sources;
  for (int t = 0; t < tensors; ++t) {
    layout.push_back({fmt::format("model/t{}", t), "float32", {static_cast<int64_t>(per / 4)},
                      0, per});
    data[static_cast<size_t>(t)].assign(per, 0);
    sources.push_back({data[static_cast<size_t>(t)].data()});
  }
  if (auto st = engine->SetLayout(layout); !st.ok()) {
    fmt::print(stderr, "peer_copy: {}\n", st.ToString());
    return 1;
  }
  std::vector<uint8_t> raw_dst(per * static_cast<uint64_t>(tensors));
  std::memset(raw_dst.data(), 1, raw_dst.size());   // pre-fault

  a->SetRound(1, 1, 1, {"b", "127.0.0.1", b->port()});
  std::vector<double> raws, commits, transfers;
  // One more commit than --reps: the first one creates and faults in both arenas.
  for (int rep = 0; rep <= reps; ++rep) {
    for (auto& d : data) std::memset(d.data(), rep + 1, d.size());
    auto t0 = Clock::now();
    for (int t = 0; t < tensors; ++t) {
      std::memcpy(raw_dst.data() + per * static_cast<uint64_t>(t),
                  data[static_cast<size_t>(t)].data(), per);
    }
    const double raw = Seconds(Clock::now() - t0);
    const uint64_t before = b->counts().received;
    t0 = Clock::now();
    auto seq = engine->Commit(sources, rep, "{}");
    const auto committed = Clock::now();
    if (!seq.ok()) {
      fmt::print(stderr, "peer_copy: commit: {}\n", seq.status().ToString());
      return 1;
    }
    while (b->counts().received == before) {
      if (Clock::now() - committed > 300s) {
        fmt::print(stderr, "peer_copy: the copy of commit {} did not arrive in 300 s\n", *seq);
        return 1;
      }
      std::this_thread::sleep_for(100us);
    }
    const double transfer = Seconds(Clock::now() - committed);
    if (rep == 0) continue;
    raws.push_back(raw);
    commits.push_back(Seconds(committed - t0));
    transfers.push_back(transfer);
  }

  const std::string own = eo.arena_path;
  const std::string peer = efdl::snapshot::ArenaPath(
      shm_b.path, kJob, "hostb.0", efdl::snapshot::PeerArenaScope("rank1"));
  // b's copy restores to the newest source, as a worker's restore would read it.
  efdl::snapshot::EngineOptions ro = eo;
  ro.arena_path = peer;
  bool same = false;
  if (auto reader = efdl::snapshot::SnapshotEngine::Open(ro); reader.ok()) {
    auto refs = (*reader)->Candidates();
    std::vector<std::vector<uint8_t>> back(static_cast<size_t>(tensors),
                                           std::vector<uint8_t>(per));
    std::vector<void*> dst;
    for (auto& v : back) dst.push_back(v.data());
    same = !refs.empty() && (*reader)->Restore(refs.front(), dst).ok() && back == data;
  }

  auto best = [](std::vector<double> v) { return *std::min_element(v.begin(), v.end()); };
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const uint64_t own_bytes = Blocks(own);
  const uint64_t peer_bytes = Blocks(peer);
  const double gib = static_cast<double>(bytes) / (1 << 30);
  fmt::print("peer copy (two PeerCopy rooms on loopback TCP, arenas in /dev/shm): state {} bytes "
             "({:.3f} GiB, {} tensors), {} reps\n", bytes, gib, tensors, reps);
  fmt::print("  sender's own arena (3 slots): {} bytes = {:.3f}x the state\n", own_bytes,
             static_cast<double>(own_bytes) / static_cast<double>(bytes));
  fmt::print("  receiver's peer arena (2 slots): {} bytes = {:.3f}x the state\n", peer_bytes,
             static_cast<double>(peer_bytes) / static_cast<double>(bytes));
  fmt::print("  raw copy (1 thread) best {:.4f} s; commit best {:.4f} s\n", best(raws),
             best(commits));
  fmt::print("  commit -> installed on the peer: best {:.4f} s, median {:.4f} s, worst {:.4f} s "
             "({:.2f} GB/s at best, {:.1f}x the raw copy); copy restored bit for bit: {}\n",
             best(transfers), median(transfers),
             *std::max_element(transfers.begin(), transfers.end()),
             static_cast<double>(bytes) / best(transfers) / 1e9, best(transfers) / best(raws),
             same ? "yes" : "NO");
  nlohmann::json out = {{"state_bytes", bytes},      {"own_arena_bytes", own_bytes},
                        {"peer_arena_bytes", peer_bytes}, {"raw_s", raws},
                        {"commit_s", commits},       {"transfer_s", transfers},
                        {"restored_equal", same}};
  fmt::print("PEERCOPY {}\n", out.dump());
  return same ? 0 : 1;
}
