// Leftovers of agents that were SIGKILLed: their private control-socket directory
// (<tmp>/efdl-agent-XXXXXX, see Agent::Run) is removed by TempDir's destructor, which a killed
// agent never runs.
#pragma once

#include <chrono>
#include <string>

#include "efdl/status.h"

namespace efdl::agent {

// The file in an agent's directory that names its owner: "<pid> <inode of its pid namespace>".
inline constexpr char kAgentOwnerFile[] = "agent.pid";

// Writes kAgentOwnerFile for this process into `dir` (before the control socket is bound).
Status WriteAgentOwnerFile(const std::string& dir);

// Removes the directories `base`/efdl-agent-* of this user that a dead agent left. Only ones
// holding nothing but the agent's own files (its owner file, control.sock, the workers' import
// reports that no agent read (zygote.h), its progress board and stack dumps), and only when:
// - the owner file names a process of this pid namespace that no longer exists: the agent is
//   dead (a Slurm task epilog's `efdl snapshots gc` right after a SIGKILL removes it). One that
//   names a live process is kept, whatever else holds;
// - without an owner file (or with one of another pid namespace): connecting to its control.sock
//   is refused and the socket file is `refused_age` old (a live agent's socket also refuses
//   between its bind() and its listen(), and a sibling agent starting at that moment must not
//   take its directory away), or it has no socket and is older than `empty_age` (it may belong
//   to an agent about to bind its socket).
// Returns how many were removed.
int RemoveStaleAgentDirs(const std::string& base,
                         std::chrono::seconds empty_age = std::chrono::seconds(60),
                         std::chrono::seconds refused_age = std::chrono::seconds(10));

}  // namespace efdl::agent
