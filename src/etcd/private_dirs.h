// The data directories of private etcds (efdl/embedded_etcd.h: `efdl run` without --etcd,
// `efdl sim`, `efdl etcd` without --data-dir): <tmp>/efdl-etcd-XXXXXX, where <tmp> is TMPDIR or
// /tmp. etcd 3.4 preallocates its write-ahead log, so each holds about 123 MB from the start.
//
// Their owner removes them: the EmbeddedEtcd when it stops, its GroupReaper when the owning
// process dies any other way (SIGKILL, the OOM killer). What is left anyway (the reaper killed
// too, a machine that lost power, an older efdl) is swept here: `efdl run`, `efdl sim` and
// `efdl etcd` remove the directories of dead owners when they start, `efdl snapshots gc` lists
// and removes them.
//
// Liveness: the owner file (kOwnerFile) inside a directory says "pid <pid> start <ticks> <comm>",
// the owning process and its start time (/proc/<pid>/stat field 22), so a reused pid is not
// taken for the owner. A directory is live while that process runs, while anyone holds the lock
// of etcd's database file (bbolt flocks member-data/member/snap/db while etcd runs), or, without
// a readable owner file, while it is younger than `young` (its owner may be about to write it).
// Only directories of this user, never through a symbolic link, are considered.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "efdl/status.h"

namespace efdl::etcd {

inline constexpr const char* kPrivateDirPrefix = "efdl-etcd";   // TempDir adds "-XXXXXX"
inline constexpr const char* kOwnerFile = "efdl-owner";

// TMPDIR when set and non-empty, else /tmp (where TempDir creates them).
std::string TempBase();

// The start time of process `pid` in clock ticks after boot (/proc/<pid>/stat field 22);
// nullopt when it does not run (or is a zombie).
std::optional<uint64_t> ProcessStartTicks(pid_t pid);

// Writes <dir>/efdl-owner naming this process.
Status WriteOwnerFile(const std::string& dir);

struct PrivateEtcdDir {
  std::string path;
  uint64_t bytes = 0;    // allocated (what it costs the file system)
  bool live = false;
  std::string owner;     // the owner file's line ("" when none)
  std::string why;       // why it counts as live or dead, for listings
};

// Every private etcd directory of this user in `base`, sorted by path.
std::vector<PrivateEtcdDir> ScanPrivateEtcdDirs(
    const std::string& base, std::chrono::seconds young = std::chrono::seconds(60));

// Removes the dead ones of `base` (dry_run: only lists them). Returns those removed (or that
// would be); failures are logged.
std::vector<PrivateEtcdDir> RemoveStalePrivateEtcdDirs(
    const std::string& base, bool dry_run = false,
    std::chrono::seconds young = std::chrono::seconds(60));

}  // namespace efdl::etcd
