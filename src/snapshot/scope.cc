#include "snapshot/scope.h"

#include <algorithm>
#include <filesystem>

namespace efdl::snapshot {

namespace {

constexpr std::string_view kRankScopePrefix = "rank";
constexpr std::string_view kRankStorePrefix = "rank-";

bool PrefixAndDigits(std::string_view s, std::string_view prefix) {
  if (!s.starts_with(prefix) || s.size() == prefix.size()) return false;
  return std::all_of(s.begin() + static_cast<std::ptrdiff_t>(prefix.size()), s.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

std::string ScopeName(bool per_rank, int rank) {
  return per_rank ? std::string(kRankScopePrefix) + std::to_string(rank)
                  : std::string(kNodeScope);
}

bool ValidScope(std::string_view scope) {
  return scope == kNodeScope || PrefixAndDigits(scope, kRankScopePrefix);
}

SnapshotRole RoleOf(bool per_rank, int rank, int local_rank) {
  SnapshotRole role;
  role.scope = ScopeName(per_rank, rank);
  role.writes_arena = per_rank || local_rank == 0;
  role.stored = role.writes_arena && (per_rank || rank == 0);
  return role;
}

std::string JobStoreDir(const std::string& snapshot_dir, const std::string& job) {
  return (std::filesystem::path(snapshot_dir) / job).string();
}

std::string StoreDir(const std::string& snapshot_dir, const std::string& job, bool per_rank,
                     int rank) {
  const std::filesystem::path dir = JobStoreDir(snapshot_dir, job);
  if (!per_rank) return dir.string();
  return (dir / (std::string(kRankStorePrefix) + std::to_string(rank))).string();
}

bool IsRankStoreName(std::string_view name) { return PrefixAndDigits(name, kRankStorePrefix); }

std::vector<std::string> RankStoreDirs(const std::string& job_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(job_dir, ec)) {
    if (IsRankStoreName(entry.path().filename().string())) out.push_back(entry.path().string());
  }
  return out;
}

}  // namespace efdl::snapshot
