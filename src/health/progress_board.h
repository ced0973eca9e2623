// The progress board: how a node's workers tell their agent that they make progress (issue #32),
// at the cost of a few stores into shared memory per step - nothing crosses a socket or etcd.
//
// One file per agent (in its private directory), mapped by the agent and by each worker: a
// header and one 64-byte slot per local rank. A worker writes only its own slot (its local rank,
// EFDL_PROGRESS_SLOT) at each State.commit() / efdl.progress(); the agent only reads, and
// clears the slots when it starts new workers. The layout is owned here; Python writes through
// efdl._efdl.ProgressSlot (src/python/bindings.cc), never by its own struct layout.
//
// Times are CLOCK_MONOTONIC nanoseconds: one clock for every process of the host.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "common/env_names.h"
#include "efdl/status.h"

namespace efdl::health {

// The environment through which the agent gives a worker its slot (worker_env.cc) and the
// signal on which the worker's Python stacks are written to EFDL_STACK_DIR/stack-<pid>.txt
// (python/efdl/_progress.py arms faulthandler for it).
inline constexpr const char* kBoardEnv = envvar::kProgressBoard;
inline constexpr const char* kSlotEnv = envvar::kProgressSlot;
inline constexpr const char* kStackDirEnv = envvar::kStackDir;
inline constexpr const char* kStackSignalEnv = envvar::kStackSignal;
// SIGRTMIN + 7 in glibc numbering (34 + 7): a real-time signal no library of the stack uses.
inline constexpr int kStackSignal = 41;

struct alignas(64) ProgressSlot {
  std::atomic<uint64_t> beats;          // progress calls so far (0: none since the slot was reset)
  std::atomic<int64_t> last_ns;         // CLOCK_MONOTONIC of the last one
  std::atomic<int64_t> step;            // the program's step at it (-1: unknown)
  std::atomic<int64_t> pause_until_ns;  // a long stretch without progress was announced until
  std::atomic<int32_t> pid;             // the writer
  std::atomic<int32_t> generation;      // bumped by the agent at each reset
  // Progress calls since the rank's newest snapshot (State.commit(): 0 right after one); what a
  // crash now would have it train again (the goodput ledger). -1: unknown (efdl.progress()).
  std::atomic<int64_t> uncommitted;
  // Samples this process' EFDL samplers handed out so far (efdl.data.DistributedSampler, the
  // Horovod layer's ElasticSampler): the agent divides its growth by the reports' to tell the
  // samples per step (the goodput ledger's samples trained again). -1: unknown (no EFDL sampler).
  std::atomic<int64_t> samples;
  // CLOCK_MONOTONIC when this rank's State finished its restore (or found nothing to restore,
  // or agreed on the state in-process) in this round: the ledger's restore phase ends there and
  // its first step begins. 0: not said (no State).
  std::atomic<int64_t> restored_ns;
  // This rank's compute time per step (issue #32 part 3, src/health/straggler_rules.h): the
  // nanoseconds from the end of each measured backward pass's predecessor to its gradients
  // being ready, summed, and the number of steps measured (python/efdl/_compute.py). Running
  // totals: the agent samples their growth.
  std::atomic<int64_t> compute_ns;
  std::atomic<int64_t> compute_steps;
  // The rest of the second cache line is free for more per-rank figures (take them from here
  // and keep the size).
  int64_t free_[6];
};
static_assert(sizeof(ProgressSlot) == 128);

int64_t MonotonicNanos();

// The files hang detection keeps in an agent's directory: the board and the workers' stack dumps
// (what a stale agent directory may hold besides its socket: src/agent/stale_dirs.cc).
inline constexpr const char* kBoardFile = "progress.board";
bool IsHealthFileName(const std::string& name);

// What the agent reads of one slot.
struct SlotView {
  uint64_t beats = 0;
  int64_t last_ns = 0;
  int64_t step = -1;
  int64_t pause_until_ns = 0;
  int32_t pid = 0;
  int64_t uncommitted = -1;
  int64_t samples = -1;
  int64_t restored_ns = 0;
  int64_t compute_ns = 0;
  int64_t compute_steps = 0;
};

// A mapped board. The agent Create()s it (size for `slots` local ranks); workers Open() it.
class ProgressBoard {
 public:
  static Result<std::unique_ptr<ProgressBoard>> Create(const std::string& path, int slots);
  static Result<std::unique_ptr<ProgressBoard>> Open(const std::string& path);
  ~ProgressBoard();
  ProgressBoard(const ProgressBoard&) = delete;
  ProgressBoard& operator=(const ProgressBoard&) = delete;

  int slots() const { return slots_; }
  const std::string& path() const { return path_; }
  SlotView Read(int slot) const;
  void Reset(int slot);
  // The worker's side: one progress call of `pid` (step -1: unknown; uncommitted: calls since
  // its newest snapshot, -1: unknown; samples: its samplers' samples so far, -1: unknown).
  void Beat(int slot, int64_t step, int32_t pid, int64_t uncommitted = -1, int64_t samples = -1);
  // One measured step of the worker: `ns` of compute (added to its running totals).
  void AddCompute(int slot, int64_t ns);
  // The worker's State finished restoring (or agreeing on) its state for this round.
  void Restored(int slot);
  // The worker took a snapshot: nothing of its work is uncommitted now (does not count as a
  // progress report).
  void Committed(int slot);
  // The worker announces no progress until now + seconds (0: the announcement ends).
  void ExpectPause(int slot, double seconds, int32_t pid);

 private:
  ProgressBoard(std::string path, void* map, size_t size, int slots)
      : path_(std::move(path)), map_(map), size_(size), slots_(slots) {}
  ProgressSlot* Slot(int i) const;
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  int slots_ = 0;
};

}  // namespace efdl::health
