#include "snapshot/arena.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "snapshot/arena_dir.h"
#include "snapshot/layout.h"

namespace efdl::snapshot {

namespace {

constexpr char kMagic[8] = {'E', 'F', 'D', 'L', 'A', 'R', 'N', '1'};
// Version 2: the slots' checksums are DataHash64's (hash.h); version 1 arenas are not opened.
constexpr uint32_t kVersion = 2;

enum SlotState : uint32_t { kEmpty = 0, kWriting = 1, kReady = 2 };

template <class T>
std::atomic_ref<T> A(T& v) {
  return std::atomic_ref<T>(v);
}

}  // namespace

// Lives at offset 0 of the mapping; every field is naturally aligned so std::atomic_ref works
// across processes.
struct SnapshotArena::Header {
  struct alignas(64) Slot {
    uint32_t state;
    uint32_t pin_pid;
    uint64_t seq;
    int64_t step;
    uint64_t manifest_len;
    uint64_t data_len;
    uint64_t checksum;
    uint64_t checksum_seq;  // seq that `checksum` belongs to; 0: none
    uint32_t hold;          // 1: the pinner asks the writer to wait (bounded) before taking it
    uint32_t reserved;      // (zero; the slot stays one 64-byte line)
  };
  char magic[8];
  uint32_t version;
  uint32_t num_slots;
  uint64_t manifest_capacity;
  uint64_t data_capacity;
  uint64_t slot_stride;
  uint64_t total_bytes;
  Slot slots[kMaxSlots];
};

SnapshotArena::SnapshotArena(std::string path, std::string file_path, uint8_t* base,
                             uint64_t size, ino_t inode)
    : path_(std::move(path)), file_path_(std::move(file_path)), base_(base), size_(size),
      inode_(inode) {}

SnapshotArena::~SnapshotArena() {
  if (base_ != nullptr) ::munmap(base_, size_);
  // A never-installed arena is garbage: nobody else can find it.
  if (file_path_ != path_) ::unlink(file_path_.c_str());
}

SnapshotArena::Header* SnapshotArena::header() const {
  static_assert(sizeof(Header) <= kPageBytes);
  return reinterpret_cast<Header*>(base_);
}
int SnapshotArena::num_slots() const { return static_cast<int>(header()->num_slots); }
uint64_t SnapshotArena::manifest_capacity() const { return header()->manifest_capacity; }
uint64_t SnapshotArena::data_capacity() const { return header()->data_capacity; }

Result<std::unique_ptr<SnapshotArena>> SnapshotArena::Create(const std::string& path,
                                                             int num_slots,
                                                             uint64_t manifest_capacity,
                                                             uint64_t data_capacity) {
  if (num_slots < 2 || num_slots > kMaxSlots) {
    return Status::InvalidArgument(
        fmt::format("snapshot arena needs 2..{} slots, got {}", kMaxSlots, num_slots));
  }
  manifest_capacity = AlignUp(std::max<uint64_t>(manifest_capacity, kPageBytes), kPageBytes);
  data_capacity = AlignUp(std::max<uint64_t>(data_capacity, kPageBytes), kPageBytes);
  const uint64_t stride = manifest_capacity + data_capacity;
  const uint64_t total = kPageBytes + stride * static_cast<uint64_t>(num_slots);
  const std::string dir = std::filesystem::path(path).parent_path().string();
  // A full tmpfs makes posix_fallocate fail below as well, but this line says what is free.
  EFDL_RETURN_IF_ERROR(CheckArenaRoom(dir.empty() ? "." : dir, total));
  std::string tmp = fmt::format("{}.new-{}", path, ::getpid());
  // A fresh file, never one found under that name (a leftover of a pid this process reuses, or
  // a link planted there): O_EXCL refuses anything present, including a symbolic link.
  (void)::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Status::IOError(fmt::format("cannot create snapshot arena {}: {}", tmp,
                                       std::strerror(errno)));
  }
  int err = ::posix_fallocate(fd, 0, static_cast<off_t>(total));
  if (err != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    Status room = CheckArenaRoom(dir.empty() ? "." : dir, total);
    if (!room.ok()) return room;  // the one clear line, now with the space really free
    return Status::IOError(fmt::format(
        "cannot reserve {} MiB of shared memory for snapshots at {}: {} (EFDL_SHM_DIR={}; "
        "enlarge it, e.g. docker --shm-size, or lower the state size)",
        total >> 20, tmp, std::strerror(err), dir));
  }
  void* base = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  struct stat st {};
  ::fstat(fd, &st);
  ::close(fd);
  if (base == MAP_FAILED) {
    ::unlink(tmp.c_str());
    return Status::IOError(fmt::format("cannot map snapshot arena {}: {}", tmp,
                                       std::strerror(errno)));
  }
  auto* h = static_cast<Header*>(base);
  std::memset(h, 0, sizeof(Header));
  h->version = kVersion;
  h->num_slots = static_cast<uint32_t>(num_slots);
  h->manifest_capacity = manifest_capacity;
  h->data_capacity = data_capacity;
  h->slot_stride = stride;
  h->total_bytes = total;
  std::memcpy(h->magic, kMagic, sizeof(kMagic));
  std::unique_ptr<SnapshotArena> arena(
      new SnapshotArena(path, tmp, static_cast<uint8_t*>(base), total, st.st_ino));
  arena->PrefaultForWrite();
  return arena;
}

void SnapshotArena::PrefaultForWrite() {
  if (prefaulted_) return;
  prefaulted_ = true;
  // MAP_POPULATE maps shared pages read-only, so the first write to each page still traps (about
  // 20 us per 4 KiB page in a VM: seconds per GiB). Populate writable page tables up front, then
  // write every page once from the CPU anyway: in a VM whose hypervisor shadows the guest's page
  // tables (the development VM), populated pages still trap on their first access, about 3 us
  // each — 0.18 s for every slot of 256 MiB that no commit has written yet, paid by the first
  // commit into it (docs/snapshots.md). Elsewhere the loop costs a few ms per GiB. The write
  // adds 0, so a snapshot a previous writer left in the arena is untouched.
#ifdef MADV_POPULATE_WRITE
  (void)::madvise(base_, size_, MADV_POPULATE_WRITE);
#endif
  for (uint64_t off = kPageBytes; off < size_; off += kPageBytes) {
    std::atomic_ref<uint8_t>(base_[off]).fetch_add(0, std::memory_order_relaxed);
  }
}

uint64_t SnapshotArena::data_file_offset(int slot) const {
  return static_cast<uint64_t>(data_area(slot) - base_);
}

Result<std::unique_ptr<SnapshotArena>> SnapshotArena::Open(const std::string& path) {
  auto opened = OpenOwnFile(path, O_RDWR, "snapshot arena");
  if (!opened.ok()) return opened.status();
  const int fd = *opened;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < kPageBytes) {
    ::close(fd);
    return Status::Corruption(fmt::format("{} is not a snapshot arena (too small)", path));
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    return Status::IOError(fmt::format("cannot map snapshot arena {}: {}", path,
                                       std::strerror(errno)));
  }
  std::unique_ptr<SnapshotArena> arena(
      new SnapshotArena(path, path, static_cast<uint8_t*>(base), size, st.st_ino));
  const Header* h = arena->header();
  if (std::memcmp(h->magic, kMagic, sizeof(kMagic)) != 0 || h->version != kVersion ||
      h->num_slots < 2 || h->num_slots > kMaxSlots ||
      h->total_bytes != size || h->slot_stride != h->manifest_capacity + h->data_capacity ||
      kPageBytes + h->slot_stride * h->num_slots != size) {
    return Status::Corruption(fmt::format(
        "{} is not a snapshot arena of this EFDL version (remove it to start fresh)", path));
  }
  return arena;
}

Status SnapshotArena::Install() {
  if (file_path_ == path_) return Status::OK();
  if (::rename(file_path_.c_str(), path_.c_str()) != 0) {
    return Status::IOError(fmt::format("cannot install snapshot arena {}: {}", path_,
                                       std::strerror(errno)));
  }
  file_path_ = path_;
  return Status::OK();
}

uint8_t* SnapshotArena::manifest_area(int slot) const {
  return base_ + kPageBytes + header()->slot_stride * static_cast<uint64_t>(slot);
}
uint8_t* SnapshotArena::data_area(int slot) const {
  return manifest_area(slot) + header()->manifest_capacity;
}

bool SnapshotArena::PinnedByLiveProcess(int slot) const {
  auto& s = header()->slots[slot];
  uint32_t pid = A(s.pin_pid).load();
  if (pid == 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  return true;
}

Result<int> SnapshotArena::BeginWrite(std::chrono::milliseconds hold_wait, bool* preempted) {
  if (preempted != nullptr) *preempted = false;
  const auto deadline = std::chrono::steady_clock::now() + hold_wait;
  for (;;) {
    bool any_hold = false;
    if (int slot = TryBeginWrite(false, &any_hold); slot >= 0) return slot;
    // Every slot but the newest is pinned. Pins without a hold are taken at once; a held one is
    // waited for, at most until the deadline (the documented bound on persistence's cost).
    if (!any_hold || std::chrono::steady_clock::now() >= deadline) {
      int slot = TryBeginWrite(true, nullptr);
      if (slot >= 0) {
        if (preempted != nullptr) *preempted = true;
        return slot;
      }
      return Status::Internal("snapshot arena has no slot besides the newest");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

int SnapshotArena::TryBeginWrite(bool take_pinned, bool* any_hold) {
  Header* h = header();
  const int n = num_slots();
  // Preference: empty/abandoned slots, then ready ones oldest first. The newest ready slot is
  // never a candidate: it is the snapshot a writer killed mid-copy must leave behind.
  std::vector<std::pair<uint64_t, int>> order;
  int newest = -1;
  uint64_t newest_seq = 0;
  for (int i = 0; i < n; ++i) {
    uint32_t st = A(h->slots[i].state).load();
    uint64_t seq = st == kReady ? A(h->slots[i].seq).load() : 0;
    if (st == kReady && (newest < 0 || seq > newest_seq)) {
      newest = i;
      newest_seq = seq;
    }
    order.emplace_back(seq, i);
  }
  std::sort(order.begin(), order.end());
  if (newest >= 0) std::erase_if(order, [&](const auto& p) { return p.second == newest; });
  if (take_pinned) {
    // Preempt: a pinned slot whose pinner did not ask for a hold first, else the oldest.
    int pick = order.empty() ? -1 : order.front().second;
    for (const auto& [seq, i] : order) {
      if (A(h->slots[i].hold).load() == 0) {
        pick = i;
        break;
      }
    }
    if (pick >= 0) {
      A(h->slots[pick].state).exchange(kWriting);
      Take(pick);
    }
    return pick;
  }
  for (const auto& [seq, i] : order) {
    auto& s = h->slots[i];
    uint32_t before = A(s.state).exchange(kWriting);  // seq_cst: pairs with Pin()'s store
    if (!PinnedByLiveProcess(i)) {
      Take(i);
      return i;
    }
    if (any_hold != nullptr && A(s.hold).load() != 0) *any_hold = true;
    A(s.state).store(before);  // untouched: give it back as it was
  }
  return -1;
}

void SnapshotArena::Take(int slot) {
  // seq 0 marks the slot as taken (a probe above only flips the state and gives it back): a
  // reader's Unchanged() fails from here on, and it must see that before any byte of new data.
  // A preempted pinner's hold is void: its pin stays until it notices, but nobody waits for it.
  A(header()->slots[slot].seq).store(0);
  A(header()->slots[slot].hold).store(0);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

void SnapshotArena::Publish(int slot, uint64_t seq, int64_t step, uint64_t manifest_len,
                            uint64_t data_len) {
  auto& s = header()->slots[slot];
  A(s.seq).store(seq, std::memory_order_relaxed);
  A(s.step).store(step, std::memory_order_relaxed);
  A(s.manifest_len).store(manifest_len, std::memory_order_relaxed);
  A(s.data_len).store(data_len, std::memory_order_relaxed);
  A(s.state).store(kReady, std::memory_order_release);
}

void SnapshotArena::Abandon(int slot) { A(header()->slots[slot].state).store(kEmpty); }

std::vector<SlotInfo> SnapshotArena::ReadySlots() const {
  std::vector<SlotInfo> out;
  for (int i = 0; i < num_slots(); ++i) {
    auto& s = header()->slots[i];
    if (A(s.state).load(std::memory_order_acquire) != kReady) continue;
    SlotInfo info{i, A(s.seq).load(std::memory_order_relaxed),
                  A(s.step).load(std::memory_order_relaxed),
                  A(s.manifest_len).load(std::memory_order_relaxed),
                  A(s.data_len).load(std::memory_order_relaxed)};
    if (!StillReady(i, info.seq)) continue;
    if (info.manifest_len > manifest_capacity() || info.data_len > data_capacity()) continue;
    out.push_back(info);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.seq > b.seq; });
  return out;
}

bool SnapshotArena::StillReady(int slot, uint64_t seq) const {
  std::atomic_thread_fence(std::memory_order_acquire);
  auto& s = header()->slots[slot];
  return A(s.state).load() == kReady && A(s.seq).load() == seq;
}

bool SnapshotArena::Unchanged(int slot, uint64_t seq) const {
  std::atomic_thread_fence(std::memory_order_acquire);
  return A(header()->slots[slot].seq).load() == seq;
}

bool SnapshotArena::Pin(int slot, uint64_t seq, bool hold) {
  auto& s = header()->slots[slot];
  const auto me = static_cast<uint32_t>(::getpid());
  uint32_t cur = A(s.pin_pid).load();
  if (cur != 0 && cur != me && PinnedByLiveProcess(slot)) return false;
  if (!A(s.pin_pid).compare_exchange_strong(cur, me)) return false;
  A(s.hold).store(hold ? 1 : 0);
  if (StillReady(slot, seq)) return true;  // seq_cst load after the pin store (see BeginWrite)
  Unpin(slot);
  return false;
}

void SnapshotArena::Unpin(int slot) {
  auto& s = header()->slots[slot];
  uint32_t me = static_cast<uint32_t>(::getpid());
  // Only this process's own pin: after a preemption the slot may be someone else's by now. The
  // pin goes before its hold: a writer that saw the pin still there with its hold already gone
  // would take the slot as a preemption while the pinner was letting it go (and a failed CAS
  // leaves the hold, which is then another pinner's, alone).
  if (!A(s.pin_pid).compare_exchange_strong(me, 0)) return;
  A(s.hold).store(0);
}

uint64_t SnapshotArena::allocated_bytes() const {
  struct stat st {};
  if (::stat(file_path_.c_str(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

void SnapshotArena::SetChecksum(int slot, uint64_t seq, uint64_t checksum) {
  auto& s = header()->slots[slot];
  A(s.checksum).store(checksum, std::memory_order_relaxed);
  A(s.checksum_seq).store(seq, std::memory_order_release);
}

std::optional<uint64_t> SnapshotArena::Checksum(int slot, uint64_t seq) const {
  auto& s = header()->slots[slot];
  if (A(s.checksum_seq).load(std::memory_order_acquire) != seq) return std::nullopt;
  uint64_t c = A(s.checksum).load(std::memory_order_relaxed);
  if (A(s.checksum_seq).load() != seq) return std::nullopt;
  return c;
}

}  // namespace efdl::snapshot
