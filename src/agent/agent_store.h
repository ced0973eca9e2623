// The node's agent store: a TCPStore server that the agent keeps for its whole life, offered
// as the master port of every round this node leads (rank 0). The round's workers, rank 0
// included, connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True, the round number as
// TORCHELASTIC_RESTART_COUNT, under which torch keeps each round's keys apart), so no rank of a
// new round waits for rank 0's program to start a server: torch 1.13 retries a refused
// connection only once a second, which cost a plain init_process_group program about 1 s at
// every membership change (docs/agent.md, "What a round change costs").
//
// The server is torch's own (any torch version's clients speak its protocol), run by
// python/efdl/_agent_store.py in one of the node's pre-started spares: a fork of the zygote,
// no interpreter start (SparePool::ActivateProgram). Without spares (--no-prestart, --launcher,
// a command that is not python, a pool that could not start) there is no agent store and rank 0's
// worker hosts the round's store, as under torchrun's static rendezvous.
//
// PROTOCOL (owned here; _agent_store.py follows it): the process names itself "efdl-store" (ps
// -o comm), and once listening writes one line `EFDL_AGENT_STORE_PORT=<port>` on its stdout and
// then serves until killed. Anything else it writes is logged a line at a time.
//
// Ownership: the AgentStore owns the process (its own process group, listed with the reaper,
// dying with the agent); destroying it kills the server. Not thread-safe: the agent loop only.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "common/subprocess.h"
#include "efdl/status.h"

namespace efdl::agent {

class SparePool;

inline constexpr std::string_view kAgentStorePortLine = "EFDL_AGENT_STORE_PORT=";

class AgentStore {
 public:
  // Runs the server in a warm spare of `pool` with `env` added to its start environment.
  // Unavailable when no spare is warm.
  static Result<std::unique_ptr<AgentStore>> Start(SparePool& pool,
                                                   const std::map<std::string, std::string>& env);
  // The process of a server started some other way (tests), with its stdout and stderr pipes.
  explicit AgentStore(Subprocess proc) : proc_(std::move(proc)) {}
  ~AgentStore() = default;
  AgentStore(const AgentStore&) = delete;
  AgentStore& operator=(const AgentStore&) = delete;

  // Non-blocking; reads and logs its output. The port once the server announced it (nullopt
  // before), Unavailable once the process ended (how, and its last stderr line).
  Result<std::optional<uint16_t>> Poll();
  pid_t pid() const { return proc_.pid(); }

 private:
  Subprocess proc_;
  PipeLines stdout_lines_;
  PipeLines stderr_lines_;
  std::string last_stderr_line_;
  std::optional<uint16_t> port_;
};

}  // namespace efdl::agent
