// Test workers as plain processes: `/usr/bin/python3 -c CODE` with this process's environment
// plus `extra` ("NAME=value" each), spawned without a shell. The caller owns the pid (kill and
// reap it).
#pragma once

#include <spawn.h>
#include <sys/types.h>

#include <string>
#include <vector>

extern char** environ;

namespace efdl::testing_support {

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
