// Helpers shared by the agent's tests.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <map>
#include <sstream>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "rendezvous/rendezvous.h"

namespace efdl::agent::testing {

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A round's place: this node `node_rank` of `nnodes`, its first global rank and worker count, the
// world size, and the rank-0 node's address.
inline rdzv::Assignment MakeAssignment(int64_t round, int node_rank, int nnodes, int rank_offset,
                                       int nproc, int world,
                                       std::string master_addr = "127.0.0.1",
                                       uint16_t master_port = 29555) {
  return {.round = round, .node_rank = node_rank, .nnodes = nnodes, .rank_offset = rank_offset,
          .nproc = nproc, .world_size = world, .master_addr = std::move(master_addr),
          .master_port = master_port};
}

// Expects each variable of `want` in a worker's or launcher's environment with its value, one
// EXPECT_EQ(env[name], value) a variable.
inline void ExpectVars(std::map<std::string, std::string>& env,
                       std::initializer_list<std::pair<std::string, std::string>> want) {
  for (const auto& [name, value] : want) EXPECT_EQ(env[name], value) << name;
}

// Polls `pred` until it holds or `timeout` passes; returns its last value.
template <class Pred>
bool WaitUntil(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() >= deadline) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// A python3 worker command line with the project's python/ on the path.
inline std::vector<std::string> PythonWorker(const std::string& code) {
  return {EFDL_PYTHON, "-c",
          std::string("import sys; sys.path.insert(0, '") + EFDL_SOURCE_DIR + "/python')\n" + code};
}

// True while `pid` exists and is not a zombie (an unreaped dead process is not alive).
inline bool ProcessAlive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// The parent pid of `pid` (-1 when gone).
inline pid_t ParentOf(pid_t pid) {
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return -1;
  char state = 0;
  int ppid = -1;
  if (std::sscanf(stat.c_str() + paren + 1, " %c %d", &state, &ppid) != 2) return -1;
  return ppid;
}

}  // namespace efdl::agent::testing
