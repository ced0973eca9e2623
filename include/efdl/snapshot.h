// In-memory snapshots with asynchronous persistence: the C++ API under efdl.State, usable directly
// from a libtorch or other C++ training program.
//
// A SnapshotEngine belongs to one writer (one process, one scope: a node or a rank). Commit()
// copies the caller's tensors as raw bytes into a shared-memory arena (/dev/shm, mode 0600) and
// publishes them atomically; a background persister writes the newest snapshot to storage
// (<snapshot-dir>/<job>/...) with write-temp, fsync, rename, fsync-dir, keeping the last K.
// A snapshot in shared memory survives the death of the process that wrote it, so a restarted
// writer restores from memory; Candidates() lists memory and storage snapshots newest first.
//
// Thread-safety: Commit, Flush, Candidates and Restore may be called from one thread at a time
// (the training thread); the persister runs on its own thread owned by the engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "efdl/status.h"

namespace efdl::snapshot {

class Env;

// One tensor of a snapshot: raw bytes at `offset` of the data region, `nbytes` long.
struct TensorEntry {
  std::string name;            // e.g. "model/fc1.weight", "optimizer/0/momentum_buffer"
  std::string dtype;           // e.g. "float32" (opaque to the engine)
  std::vector<int64_t> shape;
  uint64_t offset = 0;         // set by the engine's layout
  uint64_t nbytes = 0;
};

// What a snapshot holds besides the tensor bytes. Serialized as one JSON object; `meta_json` is
// the caller's own JSON object (non-tensor values), stored verbatim.
struct Manifest {
  std::string job;
  uint64_t seq = 0;            // commit counter: orders snapshots across restarts and storage
  int64_t step = 0;            // the caller's step, for display
  double wall_time = 0;        // seconds since the epoch at commit
  std::string scope;           // "node" or "rank<N>"
  std::vector<TensorEntry> tensors;
  uint64_t data_bytes = 0;     // size of the data region (tensors plus alignment padding)
  std::string meta_json = "{}";
  // Hex HMAC-SHA256 with the job's secret (EngineOptions::hmac_key) over the rest of the
  // manifest and the data region; empty: none. Set on stored snapshots only.
  std::string hmac;

  std::string Serialize() const;
  static Result<Manifest> Parse(std::string_view json);
  // Offsets inside the data region and no overlaps; a manifest from storage is checked first.
  Status Validate() const;
};

// A snapshot that Candidates() found, newest first.
struct SnapshotRef {
  enum class Source { kMemory, kStorage };
  Source source = Source::kStorage;
  std::string path;            // arena path or snapshot file
  int slot = -1;               // arena slot (kMemory)
  Manifest manifest;
};

struct EngineOptions {
  std::string job_id;
  std::string scope = "node";
  std::string arena_path;      // e.g. /dev/shm/efdl-<job>-<node>-node.arena
  std::string storage_dir;     // this job's (and scope's) directory; empty: no storage
  // 2..4. Three: the newest complete snapshot, one a persister may hold pinned while writing it
  // to storage, and one to write into. With two, a commit during a persist takes the persister's
  // slot (never the newest: a writer killed inside it leaves the newest intact) after waiting at
  // most kMaxHoldWait, and persistence can starve when writing a snapshot to storage takes longer
  // than the commits leave it (docs/snapshots.md, "Footprint").
  int num_slots = 3;
  int keep = 2;                // snapshots kept in storage
  bool persist = true;         // run the background persister in this process
  int copy_threads = 0;        // 0: min(4, hardware threads)
  std::chrono::milliseconds persist_min_interval{0};
  Env* env = nullptr;          // storage access and arena reads (not the mapping); nullptr: POSIX
  // Non-empty (the job's secret): stored snapshots carry an HMAC-SHA256 with this key, and a
  // storage snapshot restores only when its HMAC verifies (snapshot/hmac.h).
  std::string hmac_key;
  // true (EFDL_COMMIT_CHECKSUM=1): Commit() computes the data checksum of each snapshot (from the
  // source, right after the copy) and stores it in the slot, so a restore from memory always
  // verifies it. false, the default (commit() stays as fast as before, docs/snapshots.md): only
  // slots a persister has hashed are verified; a newer one is restored after its manifest and
  // the publish protocol are checked.
  bool commit_checksum = false;
};

// Where a commit's tensor bytes come from. `data` non-null: copied by the engine's threads.
// `data` null: `fill` is called (on the committing thread) with the tensor's place in the arena,
// e.g. for a device-to-host copy.
struct TensorSource {
  const void* data = nullptr;
};
using FillFn = std::function<Status(size_t tensor_index, void* dst)>;

class SnapshotEngine {
 public:
  static Result<std::unique_ptr<SnapshotEngine>> Open(EngineOptions options);
  virtual ~SnapshotEngine() = default;

  // Fixes the tensors of the following commits (offsets are assigned here). Cheap when the
  // layout does not change; a larger layout grows the arena at the next commit.
  virtual Status SetLayout(std::vector<TensorEntry> tensors) = 0;
  virtual const std::vector<TensorEntry>& layout() const = 0;
  // Copies one snapshot into a free slot of the arena and publishes it. Never waits for the
  // persister with 3 or more slots; with 2, at most kMaxHoldWait (src/snapshot/arena.h) when
  // the persister holds the only slot it may take. Returns the snapshot's seq.
  virtual Result<uint64_t> Commit(const std::vector<TensorSource>& sources, int64_t step,
                                  std::string_view meta_json, const FillFn& fill = {}) = 0;
  // Persists the newest committed snapshot now and waits for it (SIGTERM, graceful stop).
  virtual Status Flush(std::chrono::milliseconds timeout) = 0;
  // The persister's last failure (OK after a later success).
  virtual Status LastPersistStatus() const = 0;
  // Memory and storage snapshots, newest (highest seq) first; unreadable files are skipped with a
  // warning. Does not verify data checksums (Restore does).
  virtual std::vector<SnapshotRef> Candidates() = 0;
  // Copies tensor i of `ref` into dst[i] (nullptr: skip) and verifies its checksum. On a storage
  // snapshot the checksum is verified before anything is written to dst; with every dst null,
  // Restore only verifies.
  virtual Status Restore(const SnapshotRef& ref, const std::vector<void*>& dst) = 0;
  // The seq the next commit gets (continues after every snapshot seen at Open).
  virtual uint64_t next_seq() const = 0;
  // Makes the next commit's seq at least `seq` (never lowers it). The ranks of a round align
  // their engines with it so that one seq names the same commit on every node. Same thread as
  // Commit (not synchronised with it).
  virtual void AdvanceSeq(uint64_t seq) = 0;
};

}  // namespace efdl::snapshot
