#include "etcd/watcher.h"

#include <fmt/format.h>

#include <utility>

#include "etcd/convert.h"

namespace efdl::etcd {

WatchEngine::WatchEngine(std::shared_ptr<ChannelSet> channels)
    : BidiStreamLoop(std::move(channels), "watch") {
  StartThread();
}

WatchEngine::~WatchEngine() { Shutdown(); }

void WatchEngine::Shutdown() { StopThread(); }

int64_t WatchEngine::Add(std::string key, std::string range_end, int64_t start_revision,
                         bool progress_notify, WatchCallback callback) {
  int64_t id = 0;
  {
    MutexLock lock(mu_);
    id = next_id_++;
    Entry& e = entries_[id];
    e.key = std::move(key);
    e.range_end = std::move(range_end);
    e.progress_notify = progress_notify;
    e.next_revision = start_revision;
    e.callback = std::make_shared<WatchCallback>(std::move(callback));
    waiting_.push_back(id);
  }
  Wake();
  return id;
}

Status WatchEngine::WaitCreated(int64_t id, std::chrono::milliseconds timeout) {
  std::condition_variable_any created;
  MutexLock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.ever_created) return Status::OK();
  it->second.creation_waiter = &created;
  const bool done = created.wait_for(lock, timeout, [&]() EFDL_REQUIRES(mu_) {
    auto found = entries_.find(id);
    return found == entries_.end() || found->second.ever_created;
  });
  if (done) return Status::OK();
  entries_.at(id).creation_waiter = nullptr;   // still there: only creation or an end erase it
  return Status::DeadlineExceeded(fmt::format(
      "etcd did not acknowledge a new watch within {} ms; check that etcd is up", timeout.count()));
}

void WatchEngine::Erase(std::map<int64_t, Entry>::iterator it) {
  if (it->second.creation_waiter != nullptr) it->second.creation_waiter->notify_all();
  entries_.erase(it);
}

void WatchEngine::Remove(int64_t id) {
  {
    MutexLock lock(mu_);
    auto it = entries_.find(id);
    if (it != entries_.end()) {
      if (it->second.server_id >= 0) cancels_.push_back(it->second.server_id);
      Erase(it);
    }
    if (!OnLoopThread()) {
      ++removers_;
      delivered_.wait(lock, [&]() EFDL_REQUIRES(mu_) { return delivering_ != id; });
      --removers_;
    }
  }
  Wake();
}

bool WatchEngine::WantStream() {
  MutexLock lock(mu_);
  return !entries_.empty();
}

std::unique_ptr<WatchEngine::Stream> WatchEngine::Prepare(EndpointChannel& endpoint,
                                                          grpc::ClientContext* context,
                                                          grpc::CompletionQueue* cq) {
  return endpoint.watch->PrepareAsyncWatch(context, cq);
}

void WatchEngine::SendCancel(int64_t server_id) {
  etcdserverpb::WatchRequest request;
  request.mutable_cancel_request()->set_watch_id(server_id);
  Send(std::move(request));
}

TimePoint WatchEngine::OnTick(TimePoint /*now*/) {
  if (!stream_up()) return TimePoint::max();
  MutexLock lock(mu_);
  for (int64_t server_id : cancels_) {
    local_by_server_id_.erase(server_id);
    SendCancel(server_id);
  }
  cancels_.clear();
  while (!waiting_.empty()) {
    const int64_t id = waiting_.front();
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.phase != Phase::kWaiting) {
      waiting_.pop_front();   // removed meanwhile, or queued twice
      continue;
    }
    Entry& e = it->second;
    etcdserverpb::WatchRequest request;
    auto* create = request.mutable_create_request();
    create->set_key(e.key);
    create->set_range_end(e.range_end);
    create->set_start_revision(e.next_revision);
    create->set_progress_notify(e.progress_notify);
    if (!Send(std::move(request))) break;
    waiting_.pop_front();
    e.phase = Phase::kCreating;
    creating_.push_back(id);
  }
  return TimePoint::max();
}

void WatchEngine::OnStreamDown() {
  MutexLock lock(mu_);
  waiting_.clear();
  for (auto& [id, e] : entries_) {
    e.phase = Phase::kWaiting;
    e.server_id = -1;
    waiting_.push_back(id);   // every watch is created again on the next stream, in id order
  }
  cancels_.clear();  // the server dropped every watch of the broken stream
  creating_.clear();
  local_by_server_id_.clear();
}

void WatchEngine::OnResponse(const etcdserverpb::WatchResponse& response) {
  MutexLock lock(mu_);
  const int64_t server_id = response.watch_id();
  int64_t id = 0;
  if (response.created()) {
    if (creating_.empty()) {
      EFDL_LOG_WARN("etcd watch: unexpected 'created' for watch {}; ignored", server_id);
      return;
    }
    id = creating_.front();
    creating_.pop_front();
    auto it = entries_.find(id);
    if (it == entries_.end()) {  // removed while its create was in flight
      if (!response.canceled()) SendCancel(server_id);
      return;
    }
    if (!response.canceled()) {
      it->second.phase = Phase::kActive;
      it->second.server_id = server_id;
      it->second.ever_created = true;
      local_by_server_id_[server_id] = id;
      if (it->second.creation_waiter != nullptr) {
        it->second.creation_waiter->notify_all();
        it->second.creation_waiter = nullptr;
      }
      return;
    }
    // Created and cancelled at once: a compacted start revision or a refused request, handled
    // below like a later cancellation.
  } else {
    auto found = local_by_server_id_.find(server_id);
    if (found == local_by_server_id_.end()) return;  // cancelled by us; late responses
    id = found->second;
  }
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = it->second;

  WatchUpdate update;
  update.revision = response.header().revision();
  if (response.compact_revision() > 0 || response.canceled()) {
    // The server ended this watch: it will send nothing more for it.
    if (response.compact_revision() > 0) {
      update.compacted = true;
      update.compact_revision = response.compact_revision();
    } else {
      update.error = Status::Unavailable(fmt::format(
          "etcd cancelled the watch on '{}': {}; start a new watch", e.key,
          response.cancel_reason().empty() ? "no reason given" : response.cancel_reason()));
    }
    local_by_server_id_.erase(server_id);
    Deliver(id, update);
    auto ended = entries_.find(id);   // the callback may have removed it
    if (ended != entries_.end()) Erase(ended);
    return;
  }
  if (response.events_size() == 0) {
    // Progress notification: every event up to the header revision has been sent.
    if (e.phase == Phase::kActive) {
      e.next_revision = std::max(e.next_revision, update.revision + 1);
      if (e.progress_notify) Deliver(id, update);
    }
    return;
  }
  update.events.reserve(static_cast<size_t>(response.events_size()));
  for (const mvccpb::Event& ev : response.events()) {
    // Already delivered before a reconnection: never deliver an event twice.
    if (ev.kv().mod_revision() < e.next_revision) continue;
    WatchEvent event;
    event.type = ev.type() == mvccpb::Event::DELETE ? WatchEvent::Type::kDelete
                                                    : WatchEvent::Type::kPut;
    event.kv = ToKeyValue(ev.kv());
    update.events.push_back(std::move(event));
  }
  if (update.events.empty()) return;
  e.next_revision = update.events.back().kv.mod_revision + 1;
  Deliver(id, update);
}

void WatchEngine::Deliver(int64_t id, const WatchUpdate& update) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  std::shared_ptr<WatchCallback> callback = it->second.callback;
  delivering_ = id;
  mu_.unlock();  // the caller's MutexLock holds it again once this returns
  (*callback)(update);
  mu_.lock();
  delivering_ = 0;
  if (removers_ > 0) delivered_.notify_all();
}

}  // namespace efdl::etcd
