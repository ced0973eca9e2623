// The watch engine: every watch of one client multiplexed on one Watch stream, served by one
// thread that also runs the callbacks.
//
// Resumption: each watch remembers the first revision it has not delivered yet (the start
// revision, then last event's mod_revision + 1, or a progress notification's revision + 1).
// When the stream breaks, every watch is re-created on the next stream from that revision, and
// events below it are dropped should the server send them again: nothing is lost or repeated.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>

#include "common/thread_annotations.h"
#include "efdl/etcd.h"
#include "etcd/bidi_stream_loop.h"
#include "rpc.grpc.pb.h"

namespace efdl::etcd {

class WatchEngine final
    : public BidiStreamLoop<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse> {
 public:
  explicit WatchEngine(std::shared_ptr<ChannelSet> channels);
  ~WatchEngine() override;

  // Registers a watch delivering every event from `start_revision` (> 0) on; returns its id.
  int64_t Add(std::string key, std::string range_end, int64_t start_revision,
              bool progress_notify, WatchCallback callback);
  // Waits until etcd has acknowledged the watch's creation (or ended it, e.g. as compacted)
  // and returns OK; DeadlineExceeded when `timeout` passes first. Not on the loop thread.
  Status WaitCreated(int64_t id, std::chrono::milliseconds timeout);
  // Ends a watch. Unless called from a callback (on the loop thread), waits until the watch's
  // callback is not running; it never runs again afterwards.
  void Remove(int64_t id);
  // Stops the thread (idempotent). Watches still registered then deliver nothing more.
  void Shutdown();

 private:
  enum class Phase { kWaiting, kCreating, kActive };
  struct Entry {
    std::string key;
    std::string range_end;
    bool progress_notify = false;
    int64_t next_revision = 0;  // first revision not delivered yet
    std::shared_ptr<WatchCallback> callback;
    Phase phase = Phase::kWaiting;
    int64_t server_id = -1;     // on the current stream, once created
    bool ever_created = false;  // etcd has acknowledged it once
    // The WaitCreated of this watch, woken alone when etcd acknowledges or ends it (one shared
    // condition woke every waiting node of a 10,000-node simulation for each creation).
    std::condition_variable_any* creation_waiter = nullptr;
  };

  bool WantStream() override;
  std::unique_ptr<Stream> Prepare(EndpointChannel& endpoint, grpc::ClientContext* context,
                                  grpc::CompletionQueue* cq) override;
  void OnStreamUp() override {}
  void OnResponse(const etcdserverpb::WatchResponse& response) override;
  void OnStreamDown() override;
  TimePoint OnTick(TimePoint now) override;

  // Runs the callback of `id` with `update` outside the lock: mu_ is held on entry and exit,
  // released while the callback runs.
  void Deliver(int64_t id, const WatchUpdate& update) EFDL_REQUIRES(mu_);
  void SendCancel(int64_t server_id);
  // Erases the entry and wakes its WaitCreated, if one waits.
  void Erase(std::map<int64_t, Entry>::iterator it) EFDL_REQUIRES(mu_);

  Mutex mu_;
  std::condition_variable_any delivered_;   // a callback returned, for Remove (removers_ > 0)
  int removers_ EFDL_GUARDED_BY(mu_) = 0;   // Remove calls waiting for a callback to return
  std::map<int64_t, Entry> entries_ EFDL_GUARDED_BY(mu_);
  // Ids whose create request has not gone out on this stream (phase kWaiting), in order: OnTick
  // sends only these, so a tick costs O(new watches), not O(all watches) (issue #37: one
  // process with 30,000 watches on one stream).
  std::deque<int64_t> waiting_ EFDL_GUARDED_BY(mu_);
  std::deque<int64_t> cancels_ EFDL_GUARDED_BY(mu_);  // server ids to cancel on this stream
  int64_t next_id_ EFDL_GUARDED_BY(mu_) = 1;
  int64_t delivering_ EFDL_GUARDED_BY(mu_) = 0;       // id whose callback runs now

  // Loop thread only: local ids in the order their create requests went out on this stream
  // (etcd answers creates in order), and the server's ids of the created ones.
  std::deque<int64_t> creating_;
  std::map<int64_t, int64_t> local_by_server_id_;
};

}  // namespace efdl::etcd
