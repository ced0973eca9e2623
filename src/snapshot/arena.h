// SnapshotArena: a shared-memory file (normally under /dev/shm, mode 0600) holding N slots, each a
// manifest area plus a data area, with a header page that says which slots hold a complete
// snapshot. The file outlives the process that wrote it, so a restarted worker (or the node's
// agent) finds the newest snapshot by path.
//
// Protocol (single writer, any number of readers and pinners, across processes):
// - The writer never takes the newest ready slot, so the newest complete snapshot survives a
//   writer that dies mid-copy, with any number of slots (2 included). Among the others it prefers
//   an unpinned one: it marks it kWriting (seq_cst) and then checks its pin. When every other
//   slot is pinned it takes one anyway (preemption): at once, or, when a pinner asked for a hold,
//   after waiting at most `hold_wait` for the pin to go. Publish() stores seq/lengths and then
//   kReady (release): a reader never sees a half-written slot as ready.
// - A pin is therefore advice, not a lock: every reader (persister, restore) re-checks
//   Unchanged(slot, seq) after it has read what it needs (a seqlock: a writer that takes a slot
//   sets its seq to 0 before writing) and discards what it read when the slot was taken. A pinner stores its pid (seq_cst) and then re-checks state
//   and seq. Pins of dead processes are ignored.
//
// Thread-safety: the object is immutable after creation except through the atomics in the
// mapping; one thread writes (BeginWrite/Publish), any thread may read, pin and unpin.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "efdl/status.h"

namespace efdl::snapshot {

inline constexpr int kMaxSlots = 4;
inline constexpr uint64_t kPageBytes = 4096;
// The longest a commit waits for a persister's held pin before it takes the slot anyway: the bound
// on how long persistence can block commit() (docs/snapshots.md, "Footprint"). Without a hold a
// commit never waits.
inline constexpr std::chrono::milliseconds kMaxHoldWait{500};

struct SlotInfo {
  int slot = -1;
  uint64_t seq = 0;
  int64_t step = 0;
  uint64_t manifest_len = 0;
  uint64_t data_len = 0;
};

class SnapshotArena {
 public:
  // Creates a new arena at `path` + ".new-<pid>", sized and pre-faulted (posix_fallocate, so a full
  // /dev/shm is an error here rather than a SIGBUS later). Install() renames it over `path`.
  static Result<std::unique_ptr<SnapshotArena>> Create(const std::string& path, int num_slots,
                                                       uint64_t manifest_capacity,
                                                       uint64_t data_capacity);
  // Maps an existing arena (NotFound when there is none; Corruption on a foreign file).
  static Result<std::unique_ptr<SnapshotArena>> Open(const std::string& path);
  ~SnapshotArena();
  SnapshotArena(const SnapshotArena&) = delete;
  SnapshotArena& operator=(const SnapshotArena&) = delete;

  // Atomically replaces whatever arena is at the final path with this one.
  Status Install();

  const std::string& path() const { return path_; }
  ino_t inode() const { return inode_; }
  int num_slots() const;
  uint64_t manifest_capacity() const;
  uint64_t data_capacity() const;

  // Makes every page writable in this process's page tables now, so commits never fault.
  // Create() does it; a writer that reuses an existing arena calls it once.
  void PrefaultForWrite();
  // Where slot's data area starts in the file (readers may pread instead of mapping).
  uint64_t data_file_offset(int slot) const;

  // Writer side. BeginWrite returns the slot to fill (marked kWriting): never the newest ready
  // one; an unpinned other one if there is one, else a pinned one (preempted), after waiting up
  // to `hold_wait` while its pinner holds it (Pin with hold). `preempted`, when given, is set to
  // whether the slot was taken from a live pinner.
  Result<int> BeginWrite(std::chrono::milliseconds hold_wait = kMaxHoldWait,
                         bool* preempted = nullptr);
  uint8_t* manifest_area(int slot) const;
  uint8_t* data_area(int slot) const;
  void Publish(int slot, uint64_t seq, int64_t step, uint64_t manifest_len, uint64_t data_len);
  void Abandon(int slot);  // back to kEmpty after a failed fill

  // Reader side. Ready slots, highest seq first.
  std::vector<SlotInfo> ReadySlots() const;
  bool StillReady(int slot, uint64_t seq) const;
  // The seqlock check after reading a slot of snapshot `seq`: false once a writer has taken the
  // slot (what was read may be torn). Unlike StillReady, not fooled by the writer's probe of a
  // pinned slot (which flips its state to kWriting and back for an instant).
  bool Unchanged(int slot, uint64_t seq) const;
  // Pins a ready slot for reading. `hold`: ask the writer to wait (at most its hold_wait) before
  // taking this slot; a persister asks for it only after commits took its slot several times in a
  // row, so that persistence cannot starve. Whatever the pin, re-check StillReady after reading.
  bool Pin(int slot, uint64_t seq, bool hold = false);
  void Unpin(int slot);
  // Bytes the arena file occupies in its file system (allocated blocks, as /dev/shm counts them).
  uint64_t allocated_bytes() const;
  // A checksum computed by a pinner for (slot, seq); readers verify with it when present.
  void SetChecksum(int slot, uint64_t seq, uint64_t checksum);
  std::optional<uint64_t> Checksum(int slot, uint64_t seq) const;

 private:
  struct Header;
  SnapshotArena(std::string path, std::string file_path, uint8_t* base, uint64_t size,
                ino_t inode);
  Header* header() const;
  // -1: every slot but the newest is pinned right now. `take_pinned`: take the oldest such one.
  int TryBeginWrite(bool take_pinned, bool* any_hold);
  bool PinnedByLiveProcess(int slot) const;
  void Take(int slot);  // the writer has it: seq 0 until Publish

  std::string path_;       // final path
  std::string file_path_;  // where the file is now (differs from path_ until Install)
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  ino_t inode_ = 0;
  bool prefaulted_ = false;
};

}  // namespace efdl::snapshot
