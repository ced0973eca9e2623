// A C++ training loop that survives being killed: the C++ snapshot API without Python.
//
//   cmake --build build --target snapshot_sgd
//   build/examples/cpp/snapshot_sgd --job cpp-demo --dir /tmp/efdl-cpp --steps 300 --die-at 170
//   build/examples/cpp/snapshot_sgd --job cpp-demo --dir /tmp/efdl-cpp --steps 300
//
// The first run is SIGKILLed after step 170; the second restores the newest snapshot (from shared
// memory when the arena survived, else from the snapshot directory) and finishes. Because the
// data of a step is a pure function of the step, the resumed run ends with exactly the weights of
// an uninterrupted run: the printed `weights-fnv1a` is the same (the test checks this).
//
// The model is logistic regression with momentum on a synthetic, deterministic data set; what
// matters is the pattern: SetLayout once, Commit every K steps (a memcpy into /dev/shm, persisted
// in the background), Candidates + Restore at start, Flush at the end.
#include <signal.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "efdl/snapshot.h"

namespace {

constexpr int kFeatures = 32;
constexpr int kBatch = 64;

struct Flags {
  std::string job = "cpp-demo";
  std::string dir;            // snapshot directory; empty: memory only
  std::string arena;          // default: /dev/shm/efdl-<job>-cpp.arena
  int64_t steps = 300;
  int64_t commit_every = 10;
  int64_t die_at = -1;        // SIGKILL ourselves right after this step (a crash)
};

// splitmix64: a fixed pseudo-random stream, so sample i is the same in every run.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

float Uniform(uint64_t seed) {  // in [-1, 1)
  return static_cast<float>(static_cast<double>(Mix(seed) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

// Sample `i`: features in [-1, 1) and a label from a fixed hidden hyperplane.
void Sample(uint64_t i, float* x, float* y) {
  float dot = 0.3f;
  for (int f = 0; f < kFeatures; ++f) {
    x[f] = Uniform(i * kFeatures + static_cast<uint64_t>(f));
    dot += x[f] * Uniform(1'000'003ULL + static_cast<uint64_t>(f));
  }
  *y = dot > 0 ? 1.0f : 0.0f;
}

struct Model {
  std::vector<float> w = std::vector<float>(kFeatures + 1, 0.0f);  // last entry: bias
  std::vector<float> velocity = std::vector<float>(kFeatures + 1, 0.0f);
};

// One SGD-with-momentum step on the batch of `step`; returns the batch's mean log loss.
double TrainStep(Model& m, int64_t step) {
  std::vector<float> grad(m.w.size(), 0.0f);
  float x[kFeatures];
  float y = 0;
  double loss = 0;
  for (int b = 0; b < kBatch; ++b) {
    Sample(static_cast<uint64_t>(step) * kBatch + static_cast<uint64_t>(b), x, &y);
    float z = m.w[kFeatures];
    for (int f = 0; f < kFeatures; ++f) z += m.w[f] * x[f];
    const float p = 1.0f / (1.0f + std::exp(-z));
    loss -= y > 0 ? std::log(std::max(p, 1e-7f)) : std::log(std::max(1.0f - p, 1e-7f));
    for (int f = 0; f < kFeatures; ++f) grad[f] += (p - y) * x[f] / kBatch;
    grad[kFeatures] += (p - y) / kBatch;
  }
  for (size_t k = 0; k < m.w.size(); ++k) {
    m.velocity[k] = 0.9f * m.velocity[k] + grad[k];
    m.w[k] -= 0.5f * m.velocity[k];
  }
  return loss / kBatch;
}

uint64_t Fnv1a(const std::vector<float>& v) {
  uint64_t h = 1469598103934665603ULL;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

int Usage(const char* why) {
  std::fprintf(stderr,
               "snapshot_sgd: %s\nusage: snapshot_sgd [--job ID] [--dir DIR] [--arena PATH] "
               "[--steps N] [--commit-every K] [--die-at STEP]\n",
               why);
  return 2;
}

bool ParseInt(const char* text, int64_t* out) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0') return false;
  *out = v;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (i + 1 >= argc) return Usage(fmt::format("{} needs a value", arg).c_str());
    const char* value = argv[++i];
    bool ok = true;
    if (arg == "--job") flags.job = value;
    else if (arg == "--dir") flags.dir = value;
    else if (arg == "--arena") flags.arena = value;
    else if (arg == "--steps") ok = ParseInt(value, &flags.steps) && flags.steps > 0;
    else if (arg == "--commit-every") ok = ParseInt(value, &flags.commit_every) && flags.commit_every > 0;
    else if (arg == "--die-at") ok = ParseInt(value, &flags.die_at);
    else return Usage(fmt::format("unknown option {}", arg).c_str());
    if (!ok) return Usage(fmt::format("{} needs a positive integer, got '{}'", arg, value).c_str());
  }
  if (flags.arena.empty()) flags.arena = fmt::format("/dev/shm/efdl-{}-cpp.arena", flags.job);

  efdl::snapshot::EngineOptions options;
  options.job_id = flags.job;
  options.arena_path = flags.arena;
  options.storage_dir = flags.dir;
  auto opened = efdl::snapshot::SnapshotEngine::Open(options);
  if (!opened.ok()) {
    std::fprintf(stderr, "snapshot_sgd: %s\n", std::string(opened.status().message()).c_str());
    return 1;
  }
  auto engine = std::move(opened).value();

  Model model;
  const uint64_t n = model.w.size() * sizeof(float);
  std::vector<efdl::snapshot::TensorEntry> layout = {
      {"model/w", "float32", {static_cast<int64_t>(model.w.size())}, 0, n},
      {"optimizer/velocity", "float32", {static_cast<int64_t>(model.w.size())}, 0, n},
  };
  if (auto st = engine->SetLayout(layout); !st.ok()) {
    std::fprintf(stderr, "snapshot_sgd: %s\n", std::string(st.message()).c_str());
    return 1;
  }

  // Resume: the newest snapshot that restores cleanly (a damaged one falls back to the next).
  int64_t first_step = 0;
  for (const auto& ref : engine->Candidates()) {
    auto st = engine->Restore(ref, {model.w.data(), model.velocity.data()});
    if (!st.ok()) {
      std::fprintf(stderr, "skipping snapshot %s: %s\n", ref.path.c_str(),
                   std::string(st.message()).c_str());
      continue;
    }
    first_step = ref.manifest.step + 1;
    std::printf("restored step %lld from %s\n", static_cast<long long>(ref.manifest.step),
                ref.source == efdl::snapshot::SnapshotRef::Source::kMemory ? "memory" : "storage");
    break;
  }

  for (int64_t step = first_step; step < flags.steps; ++step) {
    const double loss = TrainStep(model, step);
    if ((step + 1) % flags.commit_every == 0) {
      auto seq = engine->Commit({{model.w.data()}, {model.velocity.data()}}, step,
                                fmt::format("{{\"step\": {}}}", step));
      if (!seq.ok()) {
        std::fprintf(stderr, "commit failed: %s\n", std::string(seq.status().message()).c_str());
        return 1;
      }
    }
    if (step % 50 == 0) std::printf("step %lld loss %.4f\n", static_cast<long long>(step), loss);
    std::fflush(stdout);
    if (step == flags.die_at) raise(SIGKILL);
  }
  if (!flags.dir.empty()) {
    if (auto st = engine->Flush(std::chrono::seconds(30)); !st.ok()) {
      std::fprintf(stderr, "persist failed: %s\n", std::string(st.message()).c_str());
      return 1;
    }
  }
  std::printf("done: %lld steps, weights-fnv1a %016llx\n", static_cast<long long>(flags.steps),
              static_cast<unsigned long long>(Fnv1a(model.w)));
  return 0;
}
