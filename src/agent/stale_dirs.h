// Leftovers of agents that were SIGKILLed: their private control-socket directory
// (<tmp>/efdl-agent-XXXXXX, see Agent::Run) is removed by TempDir's destructor, which a killed
// agent never runs.
#pragma once

#include <chrono>
#include <string>

namespace efdl::agent {

// Removes the directories `base`/efdl-agent-* of this user that a dead agent left: one holding
// only a control.sock nobody listens on any more (connecting is refused) and the workers' import
// reports that no agent read (zygote.h), or an empty one (but for such reports) older
// than `empty_age` (younger ones may belong to an agent about to bind its socket). A refusing
// socket counts only once the socket file is `refused_age` old: a live agent's socket also
// refuses between its bind() and its listen(), and a sibling agent starting at that moment must
// not take its directory away. A directory of a live agent, or with anything else in it, is
// never touched. Returns how many were removed.
int RemoveStaleAgentDirs(const std::string& base,
                         std::chrono::seconds empty_age = std::chrono::seconds(60),
                         std::chrono::seconds refused_age = std::chrono::seconds(10));

}  // namespace efdl::agent
