// WarmPool: what this node keeps warm for the next round (issue #31 step 1; docs/agent.md): the
// pre-started python workers (SparePool, forked from the zygote) and the agent store run in one
// of them for the agent's life (agent_store.h). It tells the rendezvous, for `efdl status`, once
// the pool turned itself off, and offers the store's port for the rounds this node leads (0 once
// the store died).
//
// The Agent builds the pool's options (they hold the workers' start environment) and hands the
// spares to each round's WorkerGroup; it clears them when the node stops taking part (fenced,
// excluded, evicted: refilled at its next round) and stops them when it leaves.
//
// Single-threaded: called from the Agent's loop.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>

#include "agent/agent_store.h"
#include "agent/spare_pool.h"
#include "rendezvous/rendezvous.h"

namespace efdl::agent {

class WarmPool {
 public:
  // Of `rendezvous` it calls only NoteNoPrestart and OfferAgentStore; it must outlive this.
  explicit WarmPool(rdzv::Rendezvous& rendezvous) : rdzv_(rendezvous) {}
  WarmPool(const WarmPool&) = delete;
  WarmPool& operator=(const WarmPool&) = delete;

  // Starts the spares; a line and none when the pool cannot be made (a pool that turns itself
  // off at once says why itself).
  void Start(SparePoolOptions options);
  // Before the node joins (joining starts a new round at once, so the running nodes would wait
  // for the spares' imports): waits until the spares imported the program, runs the agent store
  // in a warm spare and says whether the pool is off. Returns the signal `pending_signal` gave
  // meanwhile (0: none). Nothing without spares.
  int WarmUp(const std::function<int()>& pending_signal);
  // Every loop turn: refills the spares, tells once that the pool turned itself off, logs the
  // store's output and gives it up when it died.
  void Maintain();
  // The spares for a round's workers (null: none).
  SparePool* spares() const { return spares_.get(); }
  // The node stops taking part for now (fenced, excluded, evicted): the spares end; the pool
  // refills them at its next Maintain of a round it takes part in.
  void Clear();
  // The node leaves the job: the spares (and the zygote) end; the store lives until this does.
  void Stop() { spares_.reset(); }
  // The agent store's process (0: none).
  pid_t store_pid() const { return agent_store_ ? agent_store_->pid() : 0; }

 private:
  // Runs the agent store in a warm spare and offers its port (a line and no store when that
  // fails); the signal that arrived meanwhile (0: none).
  int StartAgentStore(const std::function<int()>& pending_signal);
  // Once the pool turned itself off (SparePool::off_reason): tells the rendezvous (once).
  void NoteNoPrestart();
  // Logs the store's output; when it died: one line, and rounds led here no longer use it.
  void CheckAgentStore();

  rdzv::Rendezvous& rdzv_;
  std::unique_ptr<SparePool> spares_;          // with --prestart (the default) for python
  std::unique_ptr<AgentStore> agent_store_;    // run in one of the spares, for the agent's life
  bool no_prestart_noted_ = false;             // NoteNoPrestart told the rendezvous
};

}  // namespace efdl::agent
