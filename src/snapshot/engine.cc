// SnapshotEngine: the writer's side (commit into the arena) plus restore and the in-process
// persister. See include/efdl/snapshot.h.
#include <sys/time.h>

#include <algorithm>
#include <optional>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "efdl/snapshot.h"
#include "snapshot/arena.h"
#include "snapshot/hash.h"
#include "snapshot/hmac.h"
#include "snapshot/layout.h"
#include "snapshot/parallel.h"
#include "snapshot/persister.h"
#include "snapshot/snapshot_file.h"
#include "snapshot/store.h"
#include "snapshot/stream_copy.h"

namespace efdl::snapshot {

namespace {

// Commits smaller than this are copied on the caller's thread: waking workers costs more.
constexpr uint64_t kParallelCopyBytes = uint64_t{4} << 20;
// Restore reads a piece in chunks this large (a multiple of the hash's 64-byte stripe): small
// enough to be hashed from L2 right after the read, large enough that the syscalls do not count.
constexpr uint64_t kRestoreChunkBytes = uint64_t{256} << 10;

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

bool SameLayout(const std::vector<TensorEntry>& a, const std::vector<TensorEntry>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].shape != b[i].shape ||
        a[i].nbytes != b[i].nbytes) {
      return false;
    }
  }
  return true;
}

// 16 members: its options and the places it writes (copy runner, store, persister, arena), the
// commit layout cached across commits (tensors, pieces, their hashes, bytes, the manifest's JSON
// parts, the next seq) and the last snapshot a Restore verified. One object on purpose: each
// commit reads them together on the caller's thread.
class Engine final : public SnapshotEngine {
 public:
  explicit Engine(EngineOptions options)
      : options_(std::move(options)),
        env_(options_.env != nullptr ? options_.env : Env::Posix()),
        runner_(options_.copy_threads > 0
                    ? options_.copy_threads
                    : static_cast<int>(std::min(4u, std::max(1u, std::thread::hardware_concurrency())))) {
    if (!options_.storage_dir.empty()) {
      store_ = std::make_unique<SnapshotStore>(env_, options_.storage_dir, options_.keep);
      if (options_.persist) {
        PersisterOptions p = PersistOptions();
        p.min_interval = options_.persist_min_interval;
        persister_ = std::make_unique<Persister>(std::move(p));
        persister_->Start();
      }
    }
  }

  Status Init() {
    nlohmann::json ids = {{"job", options_.job_id}, {"scope", options_.scope}};
    head_json_ = ids.dump();
    head_json_ = head_json_.substr(1, head_json_.size() - 2);
    tensors_json_ = TensorsJson(layout_);  // a state without tensors never changes the layout
    auto arena = SnapshotArena::Open(options_.arena_path);
    if (arena.ok()) {
      arena_ = std::move(arena).value();
      for (const auto& s : arena_->ReadySlots()) next_seq_ = std::max(next_seq_, s.seq + 1);
    } else if (!arena.status().IsNotFound()) {
      EFDL_LOG_WARN("snapshot: ignoring the shared-memory arena: {}", arena.status().message());
    }
    if (store_) {
      auto entries = store_->List();
      if (!entries.empty()) next_seq_ = std::max(next_seq_, entries.front().seq + 1);
    }
    return Status::OK();
  }

  Status SetLayout(std::vector<TensorEntry> tensors) override {
    if (SameLayout(tensors, layout_)) return Status::OK();
    layout_ = std::move(tensors);
    data_bytes_ = AssignOffsets(layout_);
    pieces_ = PiecesOf(layout_);
    // Cache the tensor list's JSON: it is most of the manifest and does not change per commit.
    tensors_json_ = TensorsJson(layout_);
    return Status::OK();
  }

  const std::vector<TensorEntry>& layout() const override { return layout_; }

  std::string ManifestText(uint64_t seq, int64_t step, std::string_view meta_json) const {
    // Per-commit path: format by hand (job and scope are JSON-escaped once, in head_json_).
    std::string out = fmt::format("{{\"format\":\"efdl-snapshot/1\",{},\"seq\":{},\"step\":{},"
                                  "\"wall_time\":{:.6f},\"data_bytes\":{},",
                                  head_json_, seq, step, WallSeconds(), data_bytes_);
    out += tensors_json_;
    out += ",\"meta\":";
    out += meta_json.empty() ? std::string_view("{}") : meta_json;
    out += '}';
    return out;
  }

  Result<uint64_t> Commit(const std::vector<TensorSource>& sources, int64_t step,
                          std::string_view meta_json, const FillFn& fill) override {
    if (sources.size() != layout_.size()) {
      return Status::InvalidArgument(fmt::format(
          "commit got {} tensors but the layout has {}", sources.size(), layout_.size()));
    }
    const uint64_t seq = next_seq_;
    const std::string text = ManifestText(seq, step, meta_json);
    std::unique_ptr<SnapshotArena> fresh;
    SnapshotArena* arena = arena_.get();
    if (arena == nullptr || arena->num_slots() != options_.num_slots ||
        arena->data_capacity() < data_bytes_ || arena->manifest_capacity() < text.size()) {
      // Grow: fill a new arena and only then rename it over the old one, so the newest complete
      // snapshot is in shared memory at every moment.
      // Data areas are sized exactly (page-aligned): most states never grow after their first
      // layout, so the 1/8 headroom every arena had until issue #35 was unused shared memory in
      // each slot. Only a state seen growing by a little (less than 1/8: an arena too small for
      // it) gets 1/8 more, so that one growing a little at a time does not make a new arena at
      // every commit; a jump (optimizer state appearing after the first step) is sized exactly.
      // The manifest area keeps room for its per-commit text (the meta) to grow.
      const bool grew = arena != nullptr && arena->data_capacity() < data_bytes_ &&
                        data_bytes_ - arena->data_capacity() < arena->data_capacity() / 8;
      auto created = SnapshotArena::Create(options_.arena_path, options_.num_slots,
                                           text.size() * 2 + (uint64_t{64} << 10),
                                           data_bytes_ + (grew ? data_bytes_ / 8 : 0));
      if (!created.ok()) return created.status();
      fresh = std::move(created).value();
      arena = fresh.get();
    } else {
      arena->PrefaultForWrite();  // once per process: an arena left by a previous writer
    }
    auto slot = arena->BeginWrite();
    if (!slot.ok()) return slot.status();
    uint8_t* data = arena->data_area(*slot);
    for (size_t i = 0; i < sources.size(); ++i) {
      if (sources[i].data != nullptr || layout_[i].nbytes == 0) continue;
      Status s = fill ? fill(i, data + layout_[i].offset)
                      : Status::InvalidArgument(
                            fmt::format("tensor '{}' has no data to commit", layout_[i].name));
      if (!s.ok()) {
        arena->Abandon(*slot);
        return s;
      }
    }
    // The data checksum is taken here, from the source right after its copy (still in the
    // cache), so every memory snapshot can be verified before a restore: also the newest one
    // after a crash, which no persister has seen (docs/snapshots.md, "Arena lifecycle").
    const bool hash = options_.commit_checksum;
    if (hash) piece_hashes_.assign(pieces_.size(), 0);
    auto copy_piece = [&](size_t i) {
      const Piece& p = pieces_[i];
      const void* src = sources[p.tensor].data;
      if (src == nullptr || p.length == 0) {  // filled in place (device tensors): hash what is in the slot
        if (hash) piece_hashes_[i] = DataHash64(data + p.offset, p.length, p.Seed());
        return;
      }
      const uint8_t* from =
          static_cast<const uint8_t*>(src) + (p.offset - layout_[p.tensor].offset);
      StreamCopy(data + p.offset, from, p.length);
      if (hash) piece_hashes_[i] = DataHash64(from, p.length, p.Seed());
    };
    if (data_bytes_ >= kParallelCopyBytes) {
      runner_.Run(pieces_.size(), copy_piece);
    } else {
      for (size_t i = 0; i < pieces_.size(); ++i) copy_piece(i);
    }
    std::memcpy(arena->manifest_area(*slot), text.data(), text.size());
    if (hash) arena->SetChecksum(*slot, seq, FoldPieceHashes(piece_hashes_));
    arena->Publish(*slot, seq, step, text.size(), data_bytes_);
    if (fresh) {
      EFDL_RETURN_IF_ERROR(fresh->Install());
      arena_ = std::move(fresh);
    }
    next_seq_ = seq + 1;
    if (persister_) persister_->Notify();
    return seq;
  }

  Status Flush(std::chrono::milliseconds timeout) override {
    if (persister_) return persister_->Flush(timeout);
    if (!store_) return Status::OK();
    Persister once(PersistOptions());
    return once.Flush(timeout);
  }

  Status LastPersistStatus() const override {
    return persister_ ? persister_->last_status() : Status::OK();
  }

  std::vector<SnapshotRef> Candidates() override {
    std::vector<SnapshotRef> out;
    if (auto arena = SnapshotArena::Open(options_.arena_path); arena.ok()) {
      for (const auto& slot : (*arena)->ReadySlots()) {
        std::string text(reinterpret_cast<const char*>((*arena)->manifest_area(slot.slot)),
                         slot.manifest_len);
        auto m = Manifest::Parse(text);
        if (!m.ok() || !m->Validate().ok() || m->data_bytes != slot.data_len ||
            !(*arena)->Unchanged(slot.slot, slot.seq)) {
          continue;
        }
        out.push_back({SnapshotRef::Source::kMemory, options_.arena_path, slot.slot,
                       std::move(m).value()});
      }
    }
    if (store_) {
      for (const auto& e : store_->List()) {
        auto info = store_->ReadInfo(e.path);
        if (!info.ok()) {
          EFDL_LOG_WARN("snapshot: skipping {}: {}", e.path, info.status().message());
          continue;
        }
        out.push_back({SnapshotRef::Source::kStorage, e.path, -1, std::move(info->manifest)});
      }
    }
    std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
      return a.manifest.seq > b.manifest.seq;  // memory before storage on equal seq (stable)
    });
    return out;
  }

  Status Restore(const SnapshotRef& ref, const std::vector<void*>& dst) override {
    if (dst.size() != ref.manifest.tensors.size()) {
      return Status::InvalidArgument(fmt::format("restore got {} destinations for {} tensors",
                                                 dst.size(), ref.manifest.tensors.size()));
    }
    return ref.source == SnapshotRef::Source::kMemory ? RestoreFromMemory(ref, dst)
                                                      : RestoreFromStorage(ref, dst);
  }

  uint64_t next_seq() const override { return next_seq_; }
  void AdvanceSeq(uint64_t seq) override { next_seq_ = std::max(next_seq_, seq); }

 private:
  Status RestoreFromMemory(const SnapshotRef& ref, const std::vector<void*>& dst) {
    auto opened = SnapshotArena::Open(ref.path);
    if (!opened.ok()) return opened.status();
    SnapshotArena& arena = **opened;
    const uint64_t seq = ref.manifest.seq;
    const bool pinned = arena.Pin(ref.slot, seq);
    if (!pinned && !arena.Unchanged(ref.slot, seq)) {
      return Status::Unavailable(fmt::format("snapshot seq {} was replaced while restoring", seq));
    }
    // The data is read with pread, not through the mapping: a fresh mapping faults on every
    // page (about 20 us each in a VM), while read() copies straight from the shared pages.
    auto file = env_->NewRandomAccessFile(ref.path);
    if (!file.ok()) {
      if (pinned) arena.Unpin(ref.slot);
      return file.status();
    }
    const uint64_t base = arena.data_file_offset(ref.slot);
    const auto& tensors = ref.manifest.tensors;
    auto pieces = PiecesOf(tensors);
    // A slot verified by an earlier Restore of this engine (same seq, still ready) is not hashed
    // again: a second call (e.g. the optimizer after the model) reads only what it asks for.
    const bool verified = verified_path_ == ref.path && verified_slot_ == ref.slot &&
                          verified_seq_ == seq;
    const auto expected = verified ? std::nullopt : arena.Checksum(ref.slot, seq);
    std::vector<uint64_t> hashes(pieces.size());
    std::vector<Status> errors(pieces.size());
    // Pieces with no destination are still read (into a scratch buffer) to verify the checksum.
    ScratchPool scratch(static_cast<size_t>(runner_.threads()), kPieceBytes);
    auto body = [&](size_t i) {
      const Piece& p = pieces[i];
      auto* out = static_cast<uint8_t*>(dst[p.tensor]);
      int held = -1;
      if (out == nullptr) {
        if (!expected) return;
        held = scratch.Acquire();
        out = scratch.buffer(held);
      } else {
        out += p.offset - tensors[p.tensor].offset;
      }
      // Read in chunks and hash each one while it is still in the cache: hashing the whole
      // piece after reading it fetched it from memory a second time.
      DataHasher hasher(p.Seed());
      uint64_t done = 0;
      while (done < p.length && errors[i].ok()) {
        const uint64_t len = std::min(kRestoreChunkBytes, p.length - done);
        errors[i] = (*file)->Read(base + p.offset + done, len, out + done);
        if (expected) hasher.Update(out + done, len - len % DataHasher::kStripe);
        done += len;
      }
      if (expected) {
        const uint64_t whole = p.length - p.length % DataHasher::kStripe;
        hashes[i] = hasher.Finish(out + whole, p.length - whole, p.length);
      }
      if (held >= 0) scratch.Release(held);
    };
    if (ref.manifest.data_bytes >= kParallelCopyBytes) {
      runner_.Run(pieces.size(), body);
    } else {
      for (size_t i = 0; i < pieces.size(); ++i) body(i);
    }
    const bool intact = arena.Unchanged(ref.slot, seq);
    if (pinned) arena.Unpin(ref.slot);
    for (const auto& e : errors) EFDL_RETURN_IF_ERROR(e);
    if (!intact) {
      return Status::Unavailable(fmt::format("snapshot seq {} was replaced while restoring", seq));
    }
    if (expected && FoldPieceHashes(hashes) != *expected) {
      return Status::Corruption(
          fmt::format("snapshot seq {} in {} failed its checksum", seq, ref.path));
    }
    if (expected) {
      verified_path_ = ref.path;
      verified_slot_ = ref.slot;
      verified_seq_ = seq;
    }
    return Status::OK();
  }

  Status RestoreFromStorage(const SnapshotRef& ref, const std::vector<void*>& dst) {
    auto file = env_->NewRandomAccessFile(ref.path);
    if (!file.ok()) return file.status();
    auto info = ReadSnapshotInfo(**file, ref.path);
    if (!info.ok()) return info.status();
    if (info->manifest.seq != ref.manifest.seq) {
      return Status::Unavailable(fmt::format("{} changed while restoring", ref.path));
    }
    // Verify first so a corrupt file never leaves half-overwritten tensors behind. A file that
    // was just verified (a Restore with no destinations, then the real one) is not hashed twice:
    // files are immutable once renamed into place.
    if (verified_path_ != ref.path || verified_seq_ != ref.manifest.seq) {
      EFDL_RETURN_IF_ERROR(VerifySnapshotData(**file, *info, ref.path, &runner_));
      if (!options_.hmac_key.empty()) {
        EFDL_RETURN_IF_ERROR(VerifySnapshotHmac(options_.hmac_key, **file, *info, ref.path));
      }
      verified_path_ = ref.path;
      verified_slot_ = -1;
      verified_seq_ = ref.manifest.seq;
    }
    return ReadSnapshotTensors(**file, *info, dst, &runner_);
  }

  // What a persister of this engine writes, and how.
  PersisterOptions PersistOptions() const {
    PersisterOptions p;
    p.arena_path = options_.arena_path;
    p.storage_dir = options_.storage_dir;
    p.keep = options_.keep;
    p.env = env_;
    p.hmac_key = options_.hmac_key;
    return p;
  }

  EngineOptions options_;
  Env* const env_;   // options_.env, or POSIX: storage and arena reads go through it
  ParallelRunner runner_;
  std::unique_ptr<SnapshotStore> store_;
  std::unique_ptr<Persister> persister_;  // declared after runner_/store_: stopped first
  std::unique_ptr<SnapshotArena> arena_;
  std::vector<TensorEntry> layout_;
  std::vector<Piece> pieces_;
  std::vector<uint64_t> piece_hashes_;  // the commit's piece hashes (commit_checksum)
  uint64_t data_bytes_ = 0;
  std::string tensors_json_;
  std::string head_json_;  // "job":...,"scope":... (escaped once)
  uint64_t next_seq_ = 1;
  std::string verified_path_;  // the last snapshot whose checksum a Restore verified
  int verified_slot_ = -1;
  uint64_t verified_seq_ = 0;
};

}  // namespace

Result<std::unique_ptr<SnapshotEngine>> SnapshotEngine::Open(EngineOptions options) {
  if (options.job_id.empty()) return Status::InvalidArgument("snapshot engine needs a job id");
  if (options.arena_path.empty()) {
    return Status::InvalidArgument("snapshot engine needs an arena path");
  }
  if (options.num_slots < 2 || options.num_slots > kMaxSlots) {
    return Status::InvalidArgument(
        fmt::format("snapshot slots must be 2..{}, got {}", kMaxSlots, options.num_slots));
  }
  if (options.keep < 1) {
    return Status::InvalidArgument(
        fmt::format("snapshots to keep must be at least 1, got {}", options.keep));
  }
  auto engine = std::make_unique<Engine>(std::move(options));
  EFDL_RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<SnapshotEngine>(std::move(engine));
}

}  // namespace efdl::snapshot
