// Test workers as plain processes: `/usr/bin/python3 -c CODE` with this process's environment
// plus `extra` ("NAME=value" each), spawned without a shell; Children kills and reaps them.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <string>
#include <vector>

extern char** environ;

namespace efdl::testing_support {

// Processes a test started (-1 entries are skipped): SIGKILLed and reaped when this goes.
struct Children {
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    for (pid_t p : pids) {
      if (p <= 0) continue;
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
  }
  std::vector<pid_t> pids;
};

// The pid of the new process (-1: it could not be spawned).
inline pid_t SpawnPython(const std::string& code, const std::vector<std::string>& extra) {
  std::vector<std::string> env_s;
  for (char** e = environ; *e != nullptr; ++e) env_s.emplace_back(*e);
  env_s.insert(env_s.end(), extra.begin(), extra.end());
  std::vector<char*> envp;
  for (auto& s : env_s) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string py = "/usr/bin/python3", dash_c = "-c", text = code;
  char* argv[] = {py.data(), dash_c.data(), text.data(), nullptr};
  pid_t pid = 0;
  if (::posix_spawn(&pid, argv[0], nullptr, nullptr, argv, envp.data()) != 0) return -1;
  return pid;
}

}  // namespace efdl::testing_support
