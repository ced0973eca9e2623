// The shared-memory arena directory (EFDL_SHM_DIR, default /dev/shm): the one owner of the arena
// naming contract between the agent, the persister, the cleanup, `efdl snapshots` and
// python/efdl/state.py (which calls these functions through efdl._efdl), plus holder locks,
// adoption after a restart and garbage collection (docs/snapshots.md, "Arena lifecycle").
//
// Names:  <dir>/efdl-<job>-<holder>-<scope>.arena   one writer's arena (scope: node | rank<N>),
//                                                   or a peer copy (scope: peer.rank<N>)
//         <dir>/efdl-<job>-<holder>.lock            the holder lock of those arenas
// <job> is SafeName(job id); <holder> is "<host>.<k>": this host's name (characters outside
// [A-Za-z0-9_.] replaced by '_', so a holder never contains '-') and the lowest index k whose
// lock no live process holds. The holder does not depend on the agent's node id (a fresh
// host-pid-random one per agent): an agent restarted on the host after its predecessor died gets
// the same holder, hence the same arena; two live agents of one job on one host get different
// ones, because each holds its lock (flock, LOCK_EX) for as long as it lives.
//
// An arena is live while its holder lock is held (by the agent, or by a standalone State's
// process). Dead arenas of the job being started are adopted by the new agent (renamed onto its
// own holder, newest snapshot per scope, each ready slot that has a checksum verified first);
// dead arenas of other jobs are removed by `efdl run` and `efdl snapshots gc`; a completed or
// suspended job removes its own and its dead ones.
//
// The planning functions (PlanGc, PlanAdoption, PlanJobRemoval) are pure; the IO around them
// (ScanArenaDir, HolderLock, ApplyAdoption, ...) is thin.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "efdl/status.h"

namespace efdl::snapshot {

// EFDL_SHM_DIR when set and non-empty, else /dev/shm.
std::string ShmDir(const char* env_value);
// The job part of file names (state.py's old _safe_name): [A-Za-z0-9_.-] kept, others '_',
// at most 80 characters.
std::string SafeName(std::string_view text);
// The job id of a job run without one (no --job, no EFDL_JOB_ID; state.py's default_job_id for a
// program without an agent, `efdl run` without --etcd): "local-<stem>-<8 hex>", the program's
// file name without extension and the start of the SHA-1 of its real path, so each program (and
// each copy of it) has its own snapshots and re-running it continues them. `program` empty: the
// current directory, stem "python" (a `python3 -c` program).
std::string LocalJobId(const std::string& program);
// "<host>.<index>" with the host reduced to [A-Za-z0-9_.] (at most 64 characters).
std::string HolderName(std::string_view host, int index);
std::string ArenaFileName(std::string_view job, std::string_view holder, std::string_view scope);
std::string ArenaPath(const std::string& dir, std::string_view job, std::string_view holder,
                      std::string_view scope);
std::string HolderLockPath(const std::string& dir, std::string_view job, std::string_view holder);

// Peer copies (issue #35 part 2, docs/snapshots.md "Peer copy"): the copy a node keeps of its ring
// predecessor's per-rank arena of scope "rank<N>" is the arena of scope "peer.rank<N>" under the
// receiving node's own holder, so its holder lock, adoption, gc and removal at the job's end are
// those of the node's own arenas. Python finds them through efdl._efdl.peer_arena_scope.
std::string PeerArenaScope(std::string_view scope);
// "rank<N>" for a peer scope "peer.rank<N>"; nullopt for anything else.
std::optional<std::string> PeerSourceScope(std::string_view peer_scope);

struct ArenaName {
  std::string job;     // the safe form
  std::string holder;
  std::string scope;
};
// The parts of an arena file name; nullopt for anything else (including ".new-<pid>" temporaries
// and lock files).
std::optional<ArenaName> ParseArenaFileName(std::string_view file_name);

// A holder lock this process holds (flock LOCK_EX on the lock file) until destroyed. The lock
// file holds one line saying who holds it ("pid 123 <what>"), which `efdl snapshots list` shows.
class HolderLock {
 public:
  // Takes the lowest free index k of <dir>/efdl-<job>-<host>.<k>.lock (k < 64). Creates `dir` if
  // missing. IOError when none is free or the directory is unusable.
  static Result<std::unique_ptr<HolderLock>> Acquire(const std::string& dir, std::string_view job,
                                                      std::string_view host,
                                                      std::string_view what);
  // Takes exactly this lock file if nobody holds it (nullptr when held by someone else).
  // shared: LOCK_SH, which other shared holders may hold too (standalone States of one job on
  // one host all use holder "<host>.0" that way); an agent's exclusive lock excludes them.
  static Result<std::unique_ptr<HolderLock>> TryLockPath(const std::string& path,
                                                          bool shared = false);
  ~HolderLock();
  HolderLock(const HolderLock&) = delete;
  HolderLock& operator=(const HolderLock&) = delete;

  const std::string& holder() const { return holder_; }
  const std::string& path() const { return path_; }
  // Writes "pid <this pid> <what>" into the lock file (what `efdl snapshots list` shows as the
  // owner; with shared holders, the last one to write).
  void SetOwner(std::string_view what);
  // Unlinks the lock file while still holding it (nobody can take this inode afterwards: an
  // acquirer re-checks the path's inode after locking).
  void RemoveFile();

 private:
  HolderLock(int fd, std::string path, std::string holder)
      : fd_(fd), path_(std::move(path)), holder_(std::move(holder)) {}
  int fd_ = -1;
  std::string path_;
  std::string holder_;
};

// Whether a live process holds the lock file at `path` (false when there is none). Probes with
// a non-blocking exclusive lock that it drops at once.
bool HolderLockHeld(const std::string& path);

// One arena file as found on disk.
struct ArenaEntry {
  std::string path;
  ArenaName name;
  uint64_t bytes = 0;          // allocated (what it costs the shared-memory file system)
  bool held = false;           // its holder lock is held by a live process
  std::string owner;           // the lock file's line ("" when none)
  std::string job;             // the job id from a ready slot's manifest ("" when none)
  std::optional<uint64_t> newest_seq;  // of its ready slots; nullopt: none or unreadable
  std::optional<int64_t> newest_step;
};

// Every arena file in `dir`, with liveness from `held` (HolderLockHeld in production, a fake in
// tests), sorted by path. Unreadable arenas are listed without job/seq.
std::vector<ArenaEntry> ScanArenaDir(const std::string& dir,
                                     const std::function<bool(const std::string&)>& held);

// gc: the dead arenas (holder lock not held), except those of `keep_job` (safe form; the job an
// agent is starting adopts its own instead). Returns the paths to remove.
std::vector<std::string> PlanGc(const std::vector<ArenaEntry>& entries,
                                std::string_view keep_job);

struct AdoptionPlan {
  struct Move {
    std::string from;
    std::string to;
    uint64_t seq = 0;
  };
  std::vector<Move> moves;           // renamed onto the adopting holder's names
  std::vector<std::string> removes;  // dead arenas of the job not worth adopting (older)
};
// The agent of `job` (safe form) holding `holder` adopts the job's dead arenas of other holders:
// per scope the one with the newest snapshot, when it is newer than the arena it has under its
// own name; the other dead ones of that job are removed. Arenas without a ready snapshot are
// removed. Live arenas of other holders are left alone.
AdoptionPlan PlanAdoption(const std::vector<ArenaEntry>& entries, std::string_view job,
                          std::string_view holder, const std::string& dir);

// A job that completed or was suspended: its arenas under `holder`, and every dead one of the
// job (earlier agents' holders, earlier node ids). Live ones of other holders stay.
std::vector<std::string> PlanJobRemoval(const std::vector<ArenaEntry>& entries,
                                        std::string_view job, std::string_view holder);

// Removes `paths`: each only while holding its holder lock (skipped if someone took it since the
// plan), then the lock files of holders left without arenas. `except_holder`'s lock is the
// caller's own and is not taken. Returns the paths removed; logs failures.
std::vector<std::string> RemoveArenas(const std::string& dir, const std::vector<std::string>& paths,
                                      std::string_view except_holder);

// Lock files in `dir` that nobody holds and that no arena belongs to (left by a holder that
// died without arenas, or whose arenas were removed): removed. Returns how many.
int RemoveOrphanLocks(const std::string& dir);

// Carries out an adoption plan (taking each dead holder's lock around its renames), then
// verifies every ready slot of each adopted arena that carries a checksum; a slot that fails is
// dropped with a warning so no worker restores it. Returns the number of arenas adopted.
int ApplyAdoption(const std::string& dir, const AdoptionPlan& plan, std::string_view holder);

// Opens a file of the shared-memory directory (an arena or a holder lock) that this user must
// own: never through a symbolic link (O_NOFOLLOW), and only a regular file owned by this
// effective user with none of the `forbidden` permission bits (an arena holds the training
// state: no group or other access at all; a holder lock only must not be writable by others).
// Anything else is refused with FailedPrecondition and one line naming the file, what is wrong
// and to remove it: a file of the expected name planted by another user would otherwise be
// mapped or written. `what` names the file in that line ("snapshot arena", "holder lock").
// Returns the open descriptor.
Result<int> OpenOwnFile(const std::string& path, int flags, std::string_view what,
                        mode_t forbidden = 077);

// Room for a new arena of `bytes` in `dir`: OK, or IOError with one line naming the
// size needed, the space free and EFDL_SHM_DIR. `free_bytes` is injectable for tests.
Status CheckArenaRoom(const std::string& dir, uint64_t bytes,
                      std::optional<uint64_t> free_bytes = std::nullopt);

}  // namespace efdl::snapshot
