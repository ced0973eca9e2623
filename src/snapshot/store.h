// SnapshotStore: one directory of snapshot files (a job's, or one rank's of a job), written the
// way leveldb publishes CURRENT: temp file -> fsync -> rename -> fsync(dir). Keeps the newest K.
//
// File names: snap-<seq, 16 digits>.efdl; temporaries: .tmp-<host>-<pid>-<seq>.efdl (ignored by
// readers, removed by later writers on the same host once their process is gone).
// Thread-safety: none; one writer per directory (the node's rank 0, or each rank with per_rank).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "efdl/snapshot.h"
#include "snapshot/env.h"
#include "snapshot/snapshot_file.h"

namespace efdl::snapshot {

class SnapshotStore {
 public:
  // `hmac_key` non-empty: Write adds the snapshot's HMAC (snapshot/hmac.h) to the manifest.
  SnapshotStore(Env* env, std::string dir, int keep, std::string hmac_key = {});

  const std::string& dir() const { return dir_; }
  // Writes one snapshot durably, then prunes to the newest `keep`. On failure (e.g. a full disk)
  // the temporary is removed and every older snapshot is left as it was.
  // `before_publish`, when given, is asked (with the snapshot's manifest) once the file is
  // durable and right before it is renamed into place; a non-OK answer removes the temporary
  // instead (nothing published).
  // `source_check`, when given, is asked after each 8 MiB of data is written (false) and once
  // more when all of it is (true), before the file is synced: a non-OK answer removes the
  // temporary (the persister's seqlock check on its arena slot, which it releases at true).
  Status Write(const Manifest& manifest, const uint8_t* data, uint64_t data_checksum,
               const std::function<Status(const Manifest&)>& before_publish = {},
               const std::function<Status(bool all_written)>& source_check = {});
  // Snapshot files by seq, newest first (names only parsed, contents not read).
  struct Entry {
    uint64_t seq = 0;
    std::string path;
  };
  std::vector<Entry> List() const;
  Result<SnapshotFileInfo> ReadInfo(const std::string& path) const;
  Status Verify(const std::string& path, ParallelRunner* runner) const;
  // Removes all but the newest `keep` snapshots; returns how many were removed.
  Result<int> Prune(int keep);
  Env* env() const { return env_; }

  static std::string FileName(uint64_t seq);

 private:
  void RemoveStaleTemporaries();
  Env* env_;
  std::string dir_;
  int keep_;
  std::string hmac_key_;  // never logged
  bool dir_made_ = false;  // a Write found or made dir_: its disappearance later is reported
};

}  // namespace efdl::snapshot
