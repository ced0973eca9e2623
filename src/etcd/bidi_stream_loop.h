// One thread that serves one gRPC bidi stream at a time, re-opening it (on the next endpoint
// after a failure) for as long as its owner wants a stream. The watch and keep-alive engines
// are built on it: all their stream traffic, timers and callbacks run on this one thread, driven
// by a completion queue, so nothing ever blocks on a read while a timer is due.
//
// Contract for subclasses: the hooks run on the loop thread only; Send() and stream_up() may be
// called on the loop thread only; Wake() from any thread. A subclass calls StartThread() at the
// end of its constructor and StopThread() at the start of its destructor, so that the thread
// never runs a hook on a half-built or half-destroyed object.
#pragma once

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "common/log.h"
#include "common/thread_annotations.h"
#include "etcd/channel_set.h"

namespace efdl::etcd {

using SteadyClock = std::chrono::steady_clock;
using TimePoint = SteadyClock::time_point;

// When a BidiStreamLoop opens its next stream after one broke: a back-off from kMin, doubled per
// break up to kMax, back to kMin once a stream answered; kUrgent after the break when the
// subclass needs a stream urgently. Loop thread only.
class ReconnectClock {
 public:
  static constexpr std::chrono::milliseconds kMin{50};
  static constexpr std::chrono::milliseconds kMax{1000};
  static constexpr std::chrono::milliseconds kUrgent{100};

  TimePoint at() const { return at_; }
  // The subclass wants a stream urgently: at most kUrgent after the last break.
  void Urgent() { at_ = std::min(at_, last_break_ + kUrgent); }
  // A stream answered: the next break backs off from kMin again.
  void Answered() { backoff_ = kMin; }
  // A stream broke at `now`.
  void Broke(TimePoint now) {
    last_break_ = now;
    at_ = last_break_ + backoff_;
    backoff_ = std::min(backoff_ * 2, kMax);
  }

 private:
  TimePoint at_{};
  TimePoint last_break_{};           // when the last stream was dropped
  std::chrono::milliseconds backoff_{kMin};
};

template <class Req, class Resp>
class BidiStreamLoop {
 public:
  BidiStreamLoop(const BidiStreamLoop&) = delete;
  BidiStreamLoop& operator=(const BidiStreamLoop&) = delete;

  // Makes the loop run its OnTick soon (new work from another thread).
  void Wake() EFDL_EXCLUDES(wake_mu_) {
    MutexLock lock(wake_mu_);
    if (wake_pending_ || stopping_) return;
    wake_pending_ = true;
    wake_alarm_.Set(&cq_, gpr_now(GPR_CLOCK_MONOTONIC), &wake_tag_);
  }

  bool OnLoopThread() const { return std::this_thread::get_id() == thread_.get_id(); }

 protected:
  using Stream = grpc::ClientAsyncReaderWriter<Req, Resp>;

  BidiStreamLoop(std::shared_ptr<ChannelSet> channels, std::string name)
      : channels_(std::move(channels)), name_(std::move(name)) {}
  virtual ~BidiStreamLoop() = default;

  void StartThread() { thread_ = std::thread([this] { Run(); }); }
  // Idempotent; must not be called on the loop thread.
  void StopThread() EFDL_EXCLUDES(wake_mu_) {
    {
      MutexLock lock(wake_mu_);
      if (stopping_) return;  // the queue may be shut down already: no more alarms
      stopping_ = true;
      if (!wake_pending_) {
        wake_pending_ = true;
        wake_alarm_.Set(&cq_, gpr_now(GPR_CLOCK_MONOTONIC), &wake_tag_);
      }
    }
    if (thread_.joinable()) thread_.join();
  }

  // Whether a stream should be open now (e.g. there is something to watch).
  virtual bool WantStream() = 0;
  // Starts the call on `endpoint` (not yet started: the loop calls StartCall).
  virtual std::unique_ptr<Stream> Prepare(EndpointChannel& endpoint, grpc::ClientContext* context,
                                          grpc::CompletionQueue* cq) = 0;
  // The stream is open: (re)send what the server must know.
  virtual void OnStreamUp() = 0;
  virtual void OnResponse(const Resp& response) = 0;
  // The stream broke (or is being closed): whatever was in flight on it is gone.
  virtual void OnStreamDown() = 0;
  // Commands and timers; returns when it next needs to run.
  virtual TimePoint OnTick(TimePoint now) = 0;
  // Whether a broken stream must be re-opened as soon as possible: then the loop retries every
  // ReconnectClock::kUrgent instead of backing off to kMax, and asks gRPC to skip its own connect
  // backoff, so the stream is back within about kUrgent of etcd serving again.
  virtual bool ReconnectUrgently() { return false; }

  // Queues a request on the open stream; false when no stream is up.
  bool Send(Req request) {
    if (!stream_ || !stream_->up || stream_->broken) return false;
    stream_->outbox.push_back(std::move(request));
    PumpWrites();
    return true;
  }
  bool stream_up() const { return stream_ && stream_->up && !stream_->broken; }
  const std::string& stream_endpoint() const { return channels_->at(stream_->endpoint).address; }

 private:
  enum class Op { kStart, kRead, kWrite, kFinish, kWake };
  struct Tag {
    Op op;
  };
  // One call on one endpoint: the gRPC objects, the answer being read, the queued requests, and
  // which of its four asynchronous operations (start, read, write, finish) are pending, each with
  // its tag. 18 fields, flat on purpose (issue #31): each flag pairs with one tag and one step of
  // Handle's state machine, which reads them together.
  struct Attempt {
    explicit Attempt(size_t e) : endpoint(e) {}
    size_t endpoint;
    grpc::ClientContext context;
    std::unique_ptr<Stream> rw;
    Resp response;
    grpc::Status final_status;
    std::deque<Req> outbox;
    bool up = false, broken = false, got_response = false;
    bool start_pending = false, read_pending = false, write_pending = false;
    bool finish_started = false, finished = false;
    Tag start_tag{Op::kStart}, read_tag{Op::kRead}, write_tag{Op::kWrite},
        finish_tag{Op::kFinish};
  };

  void Run() {
    bool stop = false;
    while (true) {
      {
        MutexLock lock(wake_mu_);
        stop = stopping_;
      }
      if (stop) break;
      TimePoint now = SteadyClock::now();
      TimePoint wake = OnTick(now);
      now = SteadyClock::now();
      if (!stream_ && WantStream()) {
        if (ReconnectUrgently()) reconnect_.Urgent();
        if (now >= reconnect_.at()) {
          Open();
        } else {
          wake = std::min(wake, reconnect_.at());
        }
      }
      void* tag = nullptr;
      bool ok = false;
      auto next = cq_.AsyncNext(&tag, &ok, ToGpr(wake));
      if (next == grpc::CompletionQueue::SHUTDOWN) break;
      if (next == grpc::CompletionQueue::GOT_EVENT) Handle(static_cast<Tag*>(tag), ok);
    }
    // Close the stream and let every pending operation complete before the queue goes; answers
    // still in flight are dropped, not handed to the subclass.
    shutting_down_ = true;
    if (stream_) {
      stream_->context.TryCancel();
      Break();
      while (stream_) {
        void* tag = nullptr;
        bool ok = false;
        if (!cq_.Next(&tag, &ok)) break;
        Handle(static_cast<Tag*>(tag), ok);
      }
    }
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  void Open() {
    size_t endpoint = channels_->preferred();
    if (ReconnectUrgently()) {
      // gRPC waits out its own connect backoff (up to GRPC_ARG_MAX_RECONNECT_BACKOFF_MS) before
      // it tries a failed address again; a call started meanwhile fails at once.
      grpc::experimental::ChannelResetConnectionBackoff(channels_->at(endpoint).channel.get());
    }
    stream_ = std::make_unique<Attempt>(endpoint);
    // Ask the member to end the stream when it loses its raft leader, so we move to another
    // member instead of waiting on one that cannot serve (as etcd's own client does).
    stream_->context.AddMetadata("hasleader", "true");
    ChannelSet::AttachToken(&stream_->context, channels_->TokenForStream(kAuthTimeout));
    stream_->rw = Prepare(channels_->at(endpoint), &stream_->context, &cq_);
    stream_->start_pending = true;
    stream_->rw->StartCall(&stream_->start_tag);
  }

  void Handle(Tag* tag, bool ok) {
    if (tag == &wake_tag_) {
      MutexLock lock(wake_mu_);
      wake_pending_ = false;
      return;
    }
    Attempt& s = *stream_;
    switch (tag->op) {
      case Op::kStart:
        s.start_pending = false;
        if (!ok || s.broken) {
          Break();
          break;
        }
        s.up = true;
        s.read_pending = true;
        s.rw->Read(&s.response, &s.read_tag);
        OnStreamUp();
        PumpWrites();
        break;
      case Op::kRead:
        s.read_pending = false;
        if (!ok || s.broken || shutting_down_) {
          Break();
          break;
        }
        if (!s.got_response) {
          s.got_response = true;
          channels_->MarkGood(s.endpoint);
          reconnect_.Answered();
        }
        OnResponse(s.response);
        if (!s.broken) {
          s.read_pending = true;
          s.rw->Read(&s.response, &s.read_tag);
        }
        break;
      case Op::kWrite:
        s.write_pending = false;
        if (!ok || s.broken) {
          Break();
          break;
        }
        s.outbox.pop_front();
        PumpWrites();
        break;
      case Op::kFinish:
        s.finished = true;
        break;
      case Op::kWake:
        break;
    }
    MaybeFinish();
  }

  void PumpWrites() {
    Attempt& s = *stream_;
    if (!s.up || s.broken || s.write_pending || s.outbox.empty()) return;
    s.write_pending = true;
    s.rw->Write(s.outbox.front(), &s.write_tag);
  }

  // Marks the stream dead; it is finished and dropped once no operation is pending on it.
  void Break() {
    Attempt& s = *stream_;
    if (s.broken) return;
    bool was_up = s.up;
    s.broken = true;
    s.up = false;
    s.context.TryCancel();
    if (was_up) OnStreamDown();
  }

  void MaybeFinish() {
    if (!stream_) return;
    Attempt& s = *stream_;
    if (!s.broken || s.start_pending || s.read_pending || s.write_pending) return;
    if (!s.finish_started) {
      s.finish_started = true;
      s.rw->Finish(&s.final_status, &s.finish_tag);
      return;
    }
    if (!s.finished) return;
    const std::string& address = channels_->at(s.endpoint).address;
    if (s.final_status.error_code() != grpc::StatusCode::CANCELLED || !s.got_response) {
      EFDL_LOG_DEBUG("etcd {} stream to {} ended: {} ({})", name_, address,
                     s.final_status.error_message(), static_cast<int>(s.final_status.error_code()));
    }
    channels_->MarkBad(s.endpoint);
    reconnect_.Broke(SteadyClock::now());
    stream_.reset();
  }

  static gpr_timespec ToGpr(TimePoint t) {
    if (t == TimePoint::max()) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    int64_t micros =
        std::chrono::duration_cast<std::chrono::microseconds>(t - SteadyClock::now()).count();
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_micros(std::max<int64_t>(micros, 0), GPR_TIMESPAN));
  }

  // Bounds the (rare) re-authentication before a stream opens, which blocks this loop.
  static constexpr std::chrono::milliseconds kAuthTimeout{2000};

  const std::shared_ptr<ChannelSet> channels_;
  const std::string name_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<Attempt> stream_;  // loop thread only
  ReconnectClock reconnect_;         // loop thread only
  bool shutting_down_ = false;       // loop thread only

  Mutex wake_mu_;
  bool wake_pending_ EFDL_GUARDED_BY(wake_mu_) = false;
  bool stopping_ EFDL_GUARDED_BY(wake_mu_) = false;
  grpc::Alarm wake_alarm_ EFDL_GUARDED_BY(wake_mu_);  // set under wake_mu_
  Tag wake_tag_{Op::kWake};

  std::thread thread_;
};

}  // namespace efdl::etcd
