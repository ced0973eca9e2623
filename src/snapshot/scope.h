// Whose snapshot goes where (issue #31): the one owner of the scope names, the storage layout and
// the rule of who writes an arena and whose arena goes to storage, for State
// (python/efdl/state.py, through efdl._efdl), the agent's persister (src/agent/agent_persister.cc),
// the agent's newest stored point (agent.cc) and `efdl snapshots` (docs/snapshots.md).
//
//   scope    "node": one copy per node (EFDL_SNAPSHOT_PER_RANK=0, the default);
//            "rank<N>": global rank N's own (EFDL_SNAPSHOT_PER_RANK=1)
//   arena    arena_dir.h: <shm dir>/efdl-<job>-<holder>-<scope>.arena
//   storage  <snapshot dir>/<job>/ for node copies, <snapshot dir>/<job>/rank-<N>/ per rank
//   writers  one per arena: local rank 0 of a node for its node copy, every rank for its own
//   stored   one copy per job: the node copy of the node running global rank 0; per rank, every
//            rank's. Under `efdl run` with a snapshot directory the agent stores them
//            (EFDL_AGENT_PERSISTS=1, agent_persister.h), else the writer process itself.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace efdl::snapshot {

inline constexpr std::string_view kNodeScope = "node";

// "node", or "rank<rank>" for per-rank snapshots.
std::string ScopeName(bool per_rank, int rank);
// "node" or "rank" followed by digits.
bool ValidScope(std::string_view scope);

// What one process (global `rank`, `local_rank` on its node) does with snapshots.
struct SnapshotRole {
  std::string scope;          // its arena's
  bool writes_arena = false;  // it commits into that arena (the arena's one writer)
  bool stored = false;        // it writes that arena, and the arena's snapshots go to storage
};
SnapshotRole RoleOf(bool per_rank, int rank, int local_rank);

// <snapshot_dir>/<job>: the job's store of node copies, and the parent of the per-rank ones.
std::string JobStoreDir(const std::string& snapshot_dir, const std::string& job);
// Where the snapshots of scope ScopeName(per_rank, rank) are stored: JobStoreDir, or its
// rank-<rank> subdirectory for per-rank snapshots.
std::string StoreDir(const std::string& snapshot_dir, const std::string& job, bool per_rank,
                     int rank);
// Whether a name in JobStoreDir is a per-rank store: "rank-" followed by digits.
bool IsRankStoreName(std::string_view name);
// JobStoreDir's per-rank stores (<job_dir>/rank-<N>) that exist, in no particular order.
std::vector<std::string> RankStoreDirs(const std::string& job_dir);

}  // namespace efdl::snapshot
