#include "snapshot/arena_dir.h"

#include <openssl/evp.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "common/log.h"
#include "efdl/snapshot.h"
#include "snapshot/arena.h"
#include "snapshot/scope.h"
#include "snapshot/snapshot_file.h"

namespace efdl::snapshot {

namespace {

constexpr int kMaxHolders = 64;
constexpr std::string_view kPrefix = "efdl-";
constexpr std::string_view kArenaSuffix = ".arena";

std::string ReadSmall(int fd) {
  char buf[256];
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return "";
  std::string out(buf, static_cast<size_t>(n));
  while (!out.empty() && (out.back() == '\n' || out.back() == '\0')) out.pop_back();
  return out;
}

std::string LockPathOf(const std::string& dir, const ArenaName& n) {
  return HolderLockPath(dir, n.job, n.holder);
}

}  // namespace

std::string ShmDir(const char* env_value) {
  return env_value != nullptr && *env_value != '\0' ? std::string(env_value) : "/dev/shm";
}

std::string SafeName(std::string_view text) {
  std::string out(text.substr(0, 80));
  for (char& c : out) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') c = '_';
  }
  return out;
}

std::string LocalJobId(const std::string& program) {
  std::error_code ec;
  std::filesystem::path path;
  std::string stem = "python";
  if (program.empty()) {
    path = std::filesystem::current_path(ec);
  } else {
    path = std::filesystem::weakly_canonical(std::filesystem::absolute(program, ec), ec);
    stem = path.stem().string();
  }
  const std::string text = path.string();
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  std::string hex = "00000000";
  if (EVP_Digest(text.data(), text.size(), digest, &len, EVP_sha1(), nullptr) == 1 && len >= 4) {
    hex = fmt::format("{:02x}{:02x}{:02x}{:02x}", digest[0], digest[1], digest[2], digest[3]);
  }
  return fmt::format("local-{}-{}", SafeName(stem), hex);
}

std::string HolderName(std::string_view host, int index) {
  std::string h(host.substr(0, 64));
  for (char& c : h) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.') c = '_';
  }
  if (h.empty()) h = "host";
  return fmt::format("{}.{}", h, index);
}

std::string ArenaFileName(std::string_view job, std::string_view holder, std::string_view scope) {
  return fmt::format("efdl-{}-{}-{}.arena", SafeName(job), holder, scope);
}

std::string ArenaPath(const std::string& dir, std::string_view job, std::string_view holder,
                      std::string_view scope) {
  return (std::filesystem::path(dir) / ArenaFileName(job, holder, scope)).string();
}

std::string HolderLockPath(const std::string& dir, std::string_view job,
                           std::string_view holder) {
  return (std::filesystem::path(dir) / fmt::format("efdl-{}-{}.lock", SafeName(job), holder))
      .string();
}

namespace {
constexpr std::string_view kPeerPrefix = "peer.";
}  // namespace

std::string PeerArenaScope(std::string_view scope) {
  return std::string(kPeerPrefix) + std::string(scope);
}

std::optional<std::string> PeerSourceScope(std::string_view peer_scope) {
  if (!peer_scope.starts_with(kPeerPrefix)) return std::nullopt;
  peer_scope.remove_prefix(kPeerPrefix.size());
  if (!ValidScope(peer_scope) || peer_scope == kNodeScope) return std::nullopt;
  return std::string(peer_scope);
}

std::optional<ArenaName> ParseArenaFileName(std::string_view name) {
  if (!name.starts_with(kPrefix) || !name.ends_with(kArenaSuffix)) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  name.remove_suffix(kArenaSuffix.size());
  const size_t scope_dash = name.rfind('-');
  if (scope_dash == std::string_view::npos) return std::nullopt;
  std::string_view scope = name.substr(scope_dash + 1);
  name = name.substr(0, scope_dash);
  const size_t holder_dash = name.rfind('-');
  if (holder_dash == std::string_view::npos || holder_dash == 0) return std::nullopt;
  std::string_view holder = name.substr(holder_dash + 1);
  if (!(ValidScope(scope) || PeerSourceScope(scope)) || holder.empty()) return std::nullopt;
  return ArenaName{std::string(name.substr(0, holder_dash)), std::string(holder),
                   std::string(scope)};
}

// -- holder locks -------------------------------------------------------------------------------

HolderLock::~HolderLock() {
  if (fd_ >= 0) ::close(fd_);  // drops the flock
}

void HolderLock::SetOwner(std::string_view what) {
  const std::string line = fmt::format("pid {} {}\n", ::getpid(), what);
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, line.data(), line.size(), 0) != static_cast<ssize_t>(line.size())) {
    EFDL_LOG_WARN("cannot write holder lock {}: {}", path_, std::strerror(errno));
  }
}

void HolderLock::RemoveFile() { ::unlink(path_.c_str()); }

Result<int> OpenOwnFile(const std::string& path, int flags, std::string_view what,
                        mode_t forbidden) {
  int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) {
      return Status::FailedPrecondition(fmt::format(
          "refusing {} {}: it is a symbolic link, which efdl never follows in the shared-memory "
          "directory (someone may have planted it); remove it",
          what, path));
    }
    if (err == ENOENT) return Status::NotFound(fmt::format("no {} at {}", what, path));
    return Status::IOError(fmt::format("cannot open {} {}: {}", what, path, std::strerror(err)));
  }
  struct stat st {};
  std::string wrong;
  if (::fstat(fd, &st) != 0) {
    wrong = fmt::format("cannot inspect it: {}", std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    wrong = "it is not a regular file";
  } else if (st.st_uid != ::geteuid()) {
    wrong = fmt::format("it belongs to uid {}, not to this user (uid {})", st.st_uid,
                        ::geteuid());
  } else if ((st.st_mode & forbidden) != 0) {
    wrong = fmt::format("its mode {:04o} lets other users {} it (efdl makes these files 0600)",
                        st.st_mode & 07777, (forbidden & 044) != 0 ? "read or write" : "write");
  }
  if (!wrong.empty()) {
    ::close(fd);
    return Status::FailedPrecondition(
        fmt::format("refusing {} {}: {}; remove it if it is not yours", what, path, wrong));
  }
  return fd;
}

Result<std::unique_ptr<HolderLock>> HolderLock::TryLockPath(const std::string& path,
                                                            bool shared) {
  // Retry when the file was replaced between open and lock (a gc unlinked it meanwhile).
  for (int attempt = 0; attempt < 8; ++attempt) {
    auto opened = OpenOwnFile(path, O_RDWR | O_CREAT, "holder lock", /*forbidden=*/022);
    if (!opened.ok()) return opened.status();
    const int fd = *opened;
    if (::flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) return std::unique_ptr<HolderLock>();
      return Status::IOError(fmt::format("cannot lock {}: {}", path, std::strerror(err)));
    }
    struct stat by_fd {}, by_path {};
    if (::fstat(fd, &by_fd) == 0 && ::stat(path.c_str(), &by_path) == 0 &&
        by_fd.st_ino == by_path.st_ino && by_fd.st_dev == by_path.st_dev) {
      std::string holder = std::filesystem::path(path).stem().string();
      holder = holder.substr(holder.rfind('-') + 1);
      return std::unique_ptr<HolderLock>(new HolderLock(fd, path, std::move(holder)));
    }
    ::close(fd);
  }
  return Status::IOError(fmt::format("cannot lock {}: it keeps being replaced", path));
}

Result<std::unique_ptr<HolderLock>> HolderLock::Acquire(const std::string& dir,
                                                        std::string_view job,
                                                        std::string_view host,
                                                        std::string_view what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  for (int k = 0; k < kMaxHolders; ++k) {
    const std::string holder = HolderName(host, k);
    auto lock = TryLockPath(HolderLockPath(dir, job, holder));
    if (!lock.ok()) {
      return Status::IOError(fmt::format("{} (EFDL_SHM_DIR={})", lock.status().message(), dir));
    }
    if (*lock == nullptr) continue;
    std::unique_ptr<HolderLock> held = std::move(lock).value();
    held->holder_ = holder;
    held->SetOwner(what);
    return held;
  }
  return Status::IOError(fmt::format(
      "every one of {} holder locks of job '{}' in {} is held by a live process (EFDL_SHM_DIR)",
      kMaxHolders, job, dir));
}

bool HolderLockHeld(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  bool held = false;
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) held = errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

// -- scanning and plans -------------------------------------------------------------------------

std::vector<ArenaEntry> ScanArenaDir(const std::string& dir,
                                     const std::function<bool(const std::string&)>& held) {
  std::vector<ArenaEntry> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    auto name = ParseArenaFileName(e.path().filename().string());
    if (!name) continue;
    ArenaEntry a;
    a.path = e.path().string();
    a.name = *name;
    struct stat st {};
    if (::stat(a.path.c_str(), &st) == 0) a.bytes = static_cast<uint64_t>(st.st_blocks) * 512;
    const std::string lock = LockPathOf(dir, a.name);
    a.held = held(lock);
    if (int fd = ::open(lock.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC); fd >= 0) {
      a.owner = ReadSmall(fd);
      ::close(fd);
    }
    if (auto arena = SnapshotArena::Open(a.path); arena.ok()) {
      for (const auto& slot : (*arena)->ReadySlots()) {
        std::string text(reinterpret_cast<const char*>((*arena)->manifest_area(slot.slot)),
                         slot.manifest_len);
        auto m = Manifest::Parse(text);
        if (!m.ok() || !(*arena)->Unchanged(slot.slot, slot.seq)) continue;
        a.job = m->job;
        a.newest_seq = slot.seq;
        a.newest_step = slot.step;
        break;  // ReadySlots is newest first
      }
    }
    out.push_back(std::move(a));
  }
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.path < y.path; });
  return out;
}

std::vector<std::string> PlanGc(const std::vector<ArenaEntry>& entries,
                                std::string_view keep_job) {
  std::vector<std::string> out;
  for (const auto& e : entries) {
    if (e.held) continue;
    if (!keep_job.empty() && e.name.job == keep_job) continue;
    out.push_back(e.path);
  }
  return out;
}

AdoptionPlan PlanAdoption(const std::vector<ArenaEntry>& entries, std::string_view job,
                          std::string_view holder, const std::string& dir) {
  AdoptionPlan plan;
  std::map<std::string, const ArenaEntry*> mine;                   // scope -> own arena
  std::map<std::string, std::vector<const ArenaEntry*>> dead;      // scope -> candidates
  for (const auto& e : entries) {
    if (e.name.job != job) continue;
    if (e.name.holder == holder) {
      mine[e.name.scope] = &e;
    } else if (!e.held) {
      dead[e.name.scope].push_back(&e);
    }
  }
  for (auto& [scope, candidates] : dead) {
    const ArenaEntry* best = nullptr;
    for (const ArenaEntry* c : candidates) {
      if (c->newest_seq && (best == nullptr || *c->newest_seq > *best->newest_seq)) best = c;
    }
    auto own = mine.find(scope);
    const bool own_newer = own != mine.end() && own->second->newest_seq && best != nullptr &&
                           *own->second->newest_seq >= *best->newest_seq;
    for (const ArenaEntry* c : candidates) {
      if (c == best && !own_newer) {
        plan.moves.push_back({c->path, ArenaPath(dir, job, holder, scope), *c->newest_seq});
      } else {
        plan.removes.push_back(c->path);
      }
    }
  }
  return plan;
}

std::vector<std::string> PlanJobRemoval(const std::vector<ArenaEntry>& entries,
                                        std::string_view job, std::string_view holder) {
  std::vector<std::string> out;
  for (const auto& e : entries) {
    if (e.name.job == job && (e.name.holder == holder || !e.held)) out.push_back(e.path);
  }
  return out;
}

// -- carrying plans out ------------------------------------------------------------------------

namespace {

// The holder locks of `paths`' arenas, taken for the duration of an operation (own one skipped).
// A path whose lock a live process holds now is dropped from the result.
struct TakenLocks {
  std::map<std::string, std::unique_ptr<HolderLock>> by_lock_path;

  bool Take(const std::string& dir, const ArenaName& n, std::string_view except_holder) {
    if (n.holder == except_holder) return true;
    const std::string lock_path = LockPathOf(dir, n);
    if (by_lock_path.contains(lock_path)) return true;
    auto lock = HolderLock::TryLockPath(lock_path);
    if (!lock.ok() || *lock == nullptr) return false;
    by_lock_path.emplace(lock_path, std::move(lock).value());
    return true;
  }

  // Unlinks the lock files of holders that have no arena left, then drops every lock.
  void Release(const std::string& dir) {
    for (auto& [path, lock] : by_lock_path) {
      const std::string stem = std::filesystem::path(path).stem().string();  // efdl-<job>-<h>
      bool any = false;
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
        const std::string f = e.path().filename().string();
        if (f.starts_with(stem + "-") && ParseArenaFileName(f)) any = true;
      }
      if (!any) lock->RemoveFile();
    }
    by_lock_path.clear();
  }
};

bool RemoveOne(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);
  if (ec) {
    EFDL_LOG_WARN("cannot remove snapshot arena {}: {}", path, ec.message());
    return false;
  }
  return true;
}

// Drops every ready slot of the arena at `path` whose checksum is present and wrong.
void VerifyAdopted(const std::string& path) {
  auto arena = SnapshotArena::Open(path);
  if (!arena.ok()) {
    EFDL_LOG_WARN("adopted snapshot arena {} is unusable ({}); removing it", path,
                  arena.status().message());
    RemoveOne(path);
    return;
  }
  for (const auto& slot : (*arena)->ReadySlots()) {
    std::string text(reinterpret_cast<const char*>((*arena)->manifest_area(slot.slot)),
                     slot.manifest_len);
    auto m = Manifest::Parse(text);
    const auto expected = (*arena)->Checksum(slot.slot, slot.seq);
    std::string problem;
    if (!m.ok() || !m->Validate().ok() || m->data_bytes != slot.data_len) {
      problem = "its manifest does not read";
    } else if (!expected) {
      // The default (EFDL_COMMIT_CHECKSUM=0): only slots a persister wrote have one.
      EFDL_LOG_INFO("snapshot seq {} (step {}) in adopted arena {} has no checksum yet (not "
                    "persisted; EFDL_COMMIT_CHECKSUM=1 hashes every commit): its manifest "
                    "checked, its data restored unverified",
                    slot.seq, slot.step, path);
      continue;
    } else if (ChecksumOfRegion(m->tensors, (*arena)->data_area(slot.slot), nullptr) !=
               *expected) {
      problem = "it fails its checksum";
    } else {
      continue;
    }
    if ((*arena)->StillReady(slot.slot, slot.seq)) {
      (*arena)->Abandon(slot.slot);
      EFDL_LOG_WARN("dropping snapshot seq {} (step {}) of adopted arena {}: {}", slot.seq,
                    slot.step, path, problem);
    }
  }
}

}  // namespace

std::vector<std::string> RemoveArenas(const std::string& dir, const std::vector<std::string>& paths,
                                      std::string_view except_holder) {
  std::vector<std::string> removed;
  TakenLocks locks;
  for (const auto& path : paths) {
    auto name = ParseArenaFileName(std::filesystem::path(path).filename().string());
    if (!name || !locks.Take(dir, *name, except_holder)) continue;  // live again: leave it
    if (RemoveOne(path)) removed.push_back(path);
  }
  locks.Release(dir);
  return removed;
}

int RemoveOrphanLocks(const std::string& dir) {
  std::set<std::string> with_arenas;  // "efdl-<job>-<holder>"
  std::vector<std::string> locks;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (auto n = ParseArenaFileName(f)) {
      with_arenas.insert(fmt::format("efdl-{}-{}", n->job, n->holder));
    } else if (f.starts_with(kPrefix) && f.ends_with(".lock")) {
      locks.push_back(e.path().string());
    }
  }
  int removed = 0;
  for (const auto& path : locks) {
    if (with_arenas.contains(std::filesystem::path(path).stem().string())) continue;
    auto lock = HolderLock::TryLockPath(path);
    if (!lock.ok() || *lock == nullptr) continue;  // held: a live holder without arenas yet
    (*lock)->RemoveFile();
    ++removed;
  }
  return removed;
}

int ApplyAdoption(const std::string& dir, const AdoptionPlan& plan, std::string_view holder) {
  TakenLocks locks;
  int adopted = 0;
  for (const auto& move : plan.moves) {
    auto name = ParseArenaFileName(std::filesystem::path(move.from).filename().string());
    if (!name || !locks.Take(dir, *name, holder)) continue;
    if (::rename(move.from.c_str(), move.to.c_str()) != 0) {
      EFDL_LOG_WARN("cannot adopt snapshot arena {} as {}: {}", move.from, move.to,
                    std::strerror(errno));
      continue;
    }
    EFDL_LOG_INFO("adopted the snapshot arena of a dead predecessor on this host: {} -> {} "
                  "(newest seq {})", move.from, move.to, move.seq);
    VerifyAdopted(move.to);
    ++adopted;
  }
  for (const auto& path : plan.removes) {
    auto name = ParseArenaFileName(std::filesystem::path(path).filename().string());
    if (name && locks.Take(dir, *name, holder)) RemoveOne(path);
  }
  locks.Release(dir);
  return adopted;
}

Status CheckArenaRoom(const std::string& dir, uint64_t bytes,
                      std::optional<uint64_t> free_bytes) {
  if (!free_bytes) {
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) != 0) return Status::OK();  // creating it reports the error
    free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
  if (*free_bytes >= bytes) return Status::OK();
  return Status::IOError(fmt::format(
      "not enough shared memory for a snapshot arena: it needs {:.1f} MiB but {} has {:.1f} MiB "
      "free (EFDL_SHM_DIR={}); free space there (`efdl snapshots gc` removes dead arenas), "
      "enlarge it (docker --shm-size) or point EFDL_SHM_DIR elsewhere",
      static_cast<double>(bytes) / (1 << 20), dir, static_cast<double>(*free_bytes) / (1 << 20),
      dir));
}

}  // namespace efdl::snapshot
