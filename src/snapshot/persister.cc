#include "snapshot/persister.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "common/log.h"
#include "efdl/snapshot.h"
#include "snapshot/snapshot_file.h"

namespace efdl::snapshot {

Persister::Persister(PersisterOptions options)
    : options_(std::move(options)),
      store_(options_.env, options_.storage_dir, options_.keep, options_.hmac_key) {
  auto entries = store_.List();
  if (!entries.empty()) persisted_seq_ = entries.front().seq;
}

Persister::~Persister() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Persister::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void Persister::Notify() {
  bool wake;
  {
    MutexLock lock(mu_);
    ++notified_;
    wake = idle_;  // while it sleeps until the next mark, a wake-up per commit would be wasted
  }
  if (wake) cv_.notify_all();
}

Status Persister::last_status() const {
  MutexLock lock(mu_);
  return last_status_;
}

uint64_t Persister::persisted_seq() const {
  MutexLock lock(mu_);
  return persisted_seq_;
}

uint64_t Persister::preemptions() const {
  MutexLock lock(mu_);
  return preemptions_;
}

void Persister::Loop() {
  // A name tools (and tests) can see in /proc/<pid>/task/*/comm: which process persists.
  ::pthread_setname_np(::pthread_self(), "efdl-persist");
  // Background work: let the training threads win the CPU (Linux nice applies per thread). A
  // flush runs on the caller's thread, so a starved persister never delays a graceful stop.
  if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10) != 0) {
    EFDL_LOG_DEBUG("snapshot persister keeps normal priority: {}", std::strerror(errno));
  }
  // The rate limit is the mark rule (commit_marks.h): only the newest ready mark is written, so
  // every node stores the same commits. Between marks the thread sleeps (not idle: a commit's
  // Notify does not wake it) until shortly before the next one is due.
  CommitMarks marks(options_.min_interval);
  uint64_t seen = 0;
  for (;;) {
    const auto quiet = marks.PollDelay(MarkClock::now(), MarkClock::duration::max());
    {
      MutexLock lock(mu_);
      if (quiet != MarkClock::duration::max() && !retry_now_) {
        cv_.wait_for(lock, quiet, [&]() EFDL_REQUIRES(mu_) { return stop_; });
      }
      idle_ = true;
      cv_.wait_for(lock, marks.PollDelay(MarkClock::now(), options_.poll_interval),
                   [&]() EFDL_REQUIRES(mu_) { return stop_ || notified_ != seen || retry_now_; });
      idle_ = false;
      if (stop_) return;
      seen = notified_;
      retry_now_ = false;
    }
    (void)PersistOnce(&marks);
  }
}

Result<bool> Persister::PersistNewestOnce() { return PersistOnce(nullptr); }

Result<bool> Persister::PersistOnce(CommitMarks* marks) {
  MutexLock lock(persist_mu_);
  auto r = PersistLocked(marks);
  MutexLock state(mu_);
  if (r.ok()) {
    last_status_ = Status::OK();
    last_logged_error_.clear();
  } else {
    last_status_ = r.status();
    if (last_logged_error_ != r.status().message()) {
      last_logged_error_ = r.status().message();
      EFDL_LOG_WARN("snapshot persistence failed, the previous snapshot is kept and training "
                    "continues: {}", r.status().message());
    }
  }
  return r;
}

Result<bool> Persister::PersistLocked(CommitMarks* marks) {
  // (Re)open the arena when absent or replaced by a larger one.
  struct stat st {};
  if (::stat(options_.arena_path.c_str(), &st) != 0) return false;  // nothing committed yet
  if (!arena_ || arena_->inode() != st.st_ino) {
    auto opened = SnapshotArena::Open(options_.arena_path);
    if (!opened.ok()) return opened.status();
    arena_ = std::move(opened).value();
  }
  uint64_t done;
  {
    MutexLock lock(mu_);
    done = persisted_seq_;
  }
  bool hold;
  {
    MutexLock lock(mu_);
    hold = preempted_in_a_row_ >= kHoldAfterPreemptions;
  }
  const std::vector<SlotInfo> ready = arena_->ReadySlots();
  uint64_t stride = 1;
  if (marks != nullptr && !ready.empty()) {
    const auto now = MarkClock::now();
    marks->Observe(ready.front().seq, now);
    stride = marks->Stride(now);
  }
  for (const SlotInfo& slot : ready) {
    if (slot.seq <= done) return false;
    if (!IsMark(slot.seq, stride)) continue;  // not a mark: an older one may be
    if (!arena_->Pin(slot.slot, slot.seq, hold)) continue;  // overwritten meanwhile: try the next
    bool pinned = true;
    bool preempted = false;
    // The seqlock check: a commit may take the pinned slot (arena.h); then what was read is
    // discarded. At `all_written` the data is in the file and the slot is released. (The arena
    // through a local: clang's lock analysis does not see persist_mu_ held inside the lambda.)
    SnapshotArena* arena = arena_.get();
    auto source_check = [&](bool all_written) -> Status {
      if (!arena->Unchanged(slot.slot, slot.seq)) {
        preempted = true;
        return Status::Cancelled(fmt::format(
            "snapshot seq {} was taken by a newer commit while it was written", slot.seq));
      }
      if (all_written) {
        arena->Unpin(slot.slot);
        pinned = false;
      }
      return Status::OK();
    };
    Status s;
    std::string text(reinterpret_cast<const char*>(arena_->manifest_area(slot.slot)),
                     slot.manifest_len);
    auto manifest = Manifest::Parse(text);
    if (!arena_->Unchanged(slot.slot, slot.seq)) {
      s = source_check(false);  // the manifest may be torn: a commit took the slot already
    } else if (!manifest.ok()) {
      s = manifest.status().WithContext(fmt::format("{} slot {}", arena_->path(), slot.slot));
    } else if (manifest->data_bytes != slot.data_len || !manifest->Validate().ok()) {
      s = Status::Corruption(fmt::format("{} slot {} has an inconsistent manifest",
                                         arena_->path(), slot.slot));
    } else {
      const uint8_t* data = arena_->data_area(slot.slot);
      auto checksum = arena_->Checksum(slot.slot, slot.seq);
      if (!checksum) {
        checksum = ChecksumOfRegion(manifest->tensors, data, nullptr);
        s = source_check(false);  // hashed from a slot a commit took: not its checksum
        if (s.ok()) arena_->SetChecksum(slot.slot, slot.seq, *checksum);
      }
      if (s.ok()) {
        const auto began = std::chrono::steady_clock::now();
        s = store_.Write(*manifest, data, *checksum, options_.before_publish, source_check);
        const auto ended = std::chrono::steady_clock::now();
        if (options_.after_write && !preempted) {
          options_.after_write(s, std::chrono::duration<double>(ended - began).count(),
                               s.ok() ? &*manifest : nullptr);
        }
      }
    }
    if (pinned) arena_->Unpin(slot.slot);
    MutexLock lock(mu_);
    if (preempted) {
      ++preemptions_;
      ++preempted_in_a_row_;
      if (!hold) {
        // Go again at once (nothing was written): the newest, or the next mark.
        retry_now_ = true;
        return false;
      }
      // Even with a hold: a commit waited kMaxHoldWait and took the slot. The thread's next
      // (held) try is at the next mark (this one is gone), so that commits pay that wait at
      // most once per interval.
      retry_now_ = true;
      return Status::Unavailable(fmt::format(
          "persistence cannot keep up with commits: they took the snapshot being written {} "
          "times in a row, the last one after waiting up to {} ms for it; storage lags shared memory "
          "until a write fits between two commits (commit less often, or set "
          "EFDL_SNAPSHOT_SLOTS=3: then commits never take the snapshot being written)",
          preempted_in_a_row_, kMaxHoldWait.count()));
    }
    if (!s.ok()) return s;
    preempted_in_a_row_ = 0;
    persisted_seq_ = std::max(persisted_seq_, slot.seq);
    cv_.notify_all();
    EFDL_LOG_DEBUG("snapshot seq {} step {} persisted to {}", slot.seq, slot.step, store_.dir());
    return true;
  }
  return false;
}

Status Persister::Flush(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  uint64_t target = 0;
  {
    struct stat st {};
    if (::stat(options_.arena_path.c_str(), &st) != 0) return Status::OK();
    auto arena = SnapshotArena::Open(options_.arena_path);
    if (!arena.ok()) return arena.status();
    auto slots = (*arena)->ReadySlots();
    if (slots.empty()) return Status::OK();
    target = slots.front().seq;
  }
  for (;;) {
    if (persisted_seq() >= target) return Status::OK();
    auto r = PersistNewestOnce();
    if (!r.ok()) return r.status();
    if (persisted_seq() >= target) return Status::OK();
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::DeadlineExceeded(
          fmt::format("snapshot seq {} was not persisted within {} ms", target, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace efdl::snapshot
