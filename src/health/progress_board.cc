#include "health/progress_board.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace efdl::health {
namespace {

constexpr uint64_t kMagic = 0x4546444c50524f47ULL;   // "EFDLPROG"
constexpr uint32_t kVersion = 2;   // 2: 128-byte slots (samples, restored_ns)
constexpr int kMaxSlots = 4096;

struct alignas(64) Header {
  uint64_t magic;
  uint32_t version;
  uint32_t slots;
};
static_assert(sizeof(Header) == 64);

size_t BoardSize(int slots) { return sizeof(Header) + sizeof(ProgressSlot) * slots; }

}  // namespace

bool IsHealthFileName(const std::string& name) {
  if (name == kBoardFile) return true;
  // stack-<pid>.txt
  if (!name.starts_with("stack-") || !name.ends_with(".txt") || name.size() <= 10) return false;
  for (size_t i = 6; i + 4 < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
  }
  return true;
}

int64_t MonotonicNanos() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

Result<std::unique_ptr<ProgressBoard>> ProgressBoard::Create(const std::string& path, int slots) {
  if (slots < 1 || slots > kMaxSlots) {
    return Status::InvalidArgument(fmt::format("a progress board holds 1..{} slots", kMaxSlots));
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    return Status::Internal(
        fmt::format("cannot create the progress board {}: {}", path, std::strerror(errno)));
  }
  const size_t size = BoardSize(slots);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int e = errno;
    ::close(fd);
    return Status::Internal(fmt::format("cannot size {}: {}", path, std::strerror(e)));
  }
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) {
    return Status::Internal(fmt::format("cannot map {}: {}", path, std::strerror(errno)));
  }
  auto* h = static_cast<Header*>(map);
  h->version = kVersion;
  h->slots = static_cast<uint32_t>(slots);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  auto board = std::unique_ptr<ProgressBoard>(new ProgressBoard(path, map, size, slots));
  for (int i = 0; i < slots; ++i) board->Reset(i);
  return board;
}

Result<std::unique_ptr<ProgressBoard>> ProgressBoard::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    return Status::NotFound(
        fmt::format("cannot open the progress board {}: {}", path, std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < sizeof(Header)) {
    ::close(fd);
    return Status::InvalidArgument(fmt::format("{} is not a progress board", path));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) {
    return Status::Internal(fmt::format("cannot map {}: {}", path, std::strerror(errno)));
  }
  const auto* h = static_cast<const Header*>(map);
  if (h->magic != kMagic || h->version != kVersion || h->slots < 1 ||
      static_cast<int>(h->slots) > kMaxSlots || BoardSize(static_cast<int>(h->slots)) > size) {
    ::munmap(map, size);
    return Status::InvalidArgument(fmt::format("{} is not a progress board of this version", path));
  }
  return std::unique_ptr<ProgressBoard>(
      new ProgressBoard(path, map, size, static_cast<int>(h->slots)));
}

ProgressBoard::~ProgressBoard() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

ProgressSlot* ProgressBoard::Slot(int i) const {
  auto* base = static_cast<char*>(map_) + sizeof(Header);
  return reinterpret_cast<ProgressSlot*>(base) + i;
}

SlotView ProgressBoard::Read(int slot) const {
  SlotView v;
  if (slot < 0 || slot >= slots_) return v;
  const ProgressSlot* s = Slot(slot);
  v.beats = s->beats.load(std::memory_order_acquire);
  v.last_ns = s->last_ns.load(std::memory_order_relaxed);
  v.step = s->step.load(std::memory_order_relaxed);
  v.pause_until_ns = s->pause_until_ns.load(std::memory_order_relaxed);
  v.pid = s->pid.load(std::memory_order_relaxed);
  v.uncommitted = s->uncommitted.load(std::memory_order_relaxed);
  v.samples = s->samples.load(std::memory_order_relaxed);
  v.restored_ns = s->restored_ns.load(std::memory_order_relaxed);
  v.compute_steps = s->compute_steps.load(std::memory_order_acquire);
  v.compute_ns = s->compute_ns.load(std::memory_order_relaxed);
  return v;
}

void ProgressBoard::Reset(int slot) {
  if (slot < 0 || slot >= slots_) return;
  ProgressSlot* s = Slot(slot);
  s->beats.store(0, std::memory_order_relaxed);
  s->last_ns.store(0, std::memory_order_relaxed);
  s->step.store(-1, std::memory_order_relaxed);
  s->pause_until_ns.store(0, std::memory_order_relaxed);
  s->pid.store(0, std::memory_order_relaxed);
  s->uncommitted.store(-1, std::memory_order_relaxed);
  s->samples.store(-1, std::memory_order_relaxed);
  s->restored_ns.store(0, std::memory_order_relaxed);
  s->compute_ns.store(0, std::memory_order_relaxed);
  s->compute_steps.store(0, std::memory_order_relaxed);
  s->generation.fetch_add(1, std::memory_order_release);
}

void ProgressBoard::Beat(int slot, int64_t step, int32_t pid, int64_t uncommitted,
                         int64_t samples) {
  if (slot < 0 || slot >= slots_) return;
  ProgressSlot* s = Slot(slot);
  s->pid.store(pid, std::memory_order_relaxed);
  s->step.store(step, std::memory_order_relaxed);
  s->uncommitted.store(uncommitted, std::memory_order_relaxed);
  s->samples.store(samples, std::memory_order_relaxed);
  s->last_ns.store(MonotonicNanos(), std::memory_order_relaxed);
  s->beats.fetch_add(1, std::memory_order_release);
}

void ProgressBoard::AddCompute(int slot, int64_t ns) {
  if (slot < 0 || slot >= slots_ || ns < 0) return;
  ProgressSlot* s = Slot(slot);
  // One writer per slot: the time first, then the count the reader loads first (acquire).
  s->compute_ns.store(s->compute_ns.load(std::memory_order_relaxed) + ns,
                      std::memory_order_relaxed);
  s->compute_steps.store(s->compute_steps.load(std::memory_order_relaxed) + 1,
                         std::memory_order_release);
}

void ProgressBoard::Restored(int slot) {
  if (slot < 0 || slot >= slots_) return;
  Slot(slot)->restored_ns.store(MonotonicNanos(), std::memory_order_release);
}

void ProgressBoard::Committed(int slot) {
  if (slot < 0 || slot >= slots_) return;
  Slot(slot)->uncommitted.store(0, std::memory_order_relaxed);
}

void ProgressBoard::ExpectPause(int slot, double seconds, int32_t pid) {
  if (slot < 0 || slot >= slots_) return;
  ProgressSlot* s = Slot(slot);
  s->pid.store(pid, std::memory_order_relaxed);
  const int64_t until =
      seconds > 0 ? MonotonicNanos() + static_cast<int64_t>(seconds * 1e9) : 0;
  s->pause_until_ns.store(until, std::memory_order_release);
}

}  // namespace efdl::health
