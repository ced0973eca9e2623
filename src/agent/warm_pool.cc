// WarmPool (warm_pool.h): the node's spares and its agent store.
#include "agent/warm_pool.h"

#include <chrono>
#include <thread>

#include "common/log.h"

namespace efdl::agent {

void WarmPool::Start(SparePoolOptions options) {
  const int nproc = options.nproc;
  const bool requested = options.requested;
  auto pool = SparePool::Create(std::move(options));
  if (!pool.ok()) {
    EFDL_LOG_WARN("{}", pool.status().message());
    return;
  }
  spares_ = std::move(pool).value();
  if (!spares_->enabled()) return;   // it said why
  spares_->Maintain();
  EFDL_LOG_INFO("pre-starting {} python worker(s) ({})", nproc,
                requested ? "--prestart" : "default for python commands; --no-prestart: off");
}

int WarmPool::WarmUp(const std::function<int()>& pending_signal) {
  if (!spares_) return 0;
  int sig = 0;
  spares_->WaitUntilImported([&] { return (sig = pending_signal()) != 0; });
  if (sig != 0) return sig;
  sig = StartAgentStore(pending_signal);
  if (sig != 0) return sig;
  NoteNoPrestart();
  return 0;
}

void WarmPool::Maintain() {
  if (spares_) {
    spares_->Maintain();
    NoteNoPrestart();
  }
  if (agent_store_) CheckAgentStore();
}

void WarmPool::Clear() {
  if (spares_) spares_->Clear();
}

void WarmPool::NoteNoPrestart() {
  if (no_prestart_noted_ || spares_->enabled()) return;
  rdzv_.NoteNoPrestart(spares_->off_reason());
  no_prestart_noted_ = true;
}

int WarmPool::StartAgentStore(const std::function<int()>& pending_signal) {
  spares_->Importing();   // notices the spares that became warm since WaitUntilImported
  auto store = AgentStore::Start(*spares_, {});
  if (!store.ok()) {
    EFDL_LOG_INFO("no agent store ({}): rank 0's worker hosts the store of a round this node "
                  "leads", store.status().message());
    return 0;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (true) {
    auto port = (*store)->Poll();
    if (!port.ok() || *port || std::chrono::steady_clock::now() >= deadline) {
      if (port.ok() && *port) {
        EFDL_LOG_INFO("agent store (pid {}) listens on port {}: the workers of a round this "
                      "node leads meet there", (*store)->pid(), **port);
        rdzv_.OfferAgentStore(**port);
        agent_store_ = std::move(store).value();
      } else {
        EFDL_LOG_WARN("{}; rank 0's worker hosts the store of a round this node leads",
                      port.ok() ? "the agent store announced no port within 10 s"
                                : port.status().message());
      }
      return 0;
    }
    if (const int sig = pending_signal(); sig != 0) return sig;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void WarmPool::CheckAgentStore() {
  auto port = agent_store_->Poll();
  if (port.ok()) return;
  EFDL_LOG_WARN("{}; from the next round on, rank 0's worker hosts the store of a round this "
                "node leads", port.status().message());
  rdzv_.OfferAgentStore(0);
  agent_store_.reset();
}

}  // namespace efdl::agent
