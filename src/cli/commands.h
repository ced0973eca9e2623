// The `efdl` command's subcommands. Each subsystem registers its own in its own file; main.cc
// only lists them. A subcommand's parse callback hands the runner the action to run after
// parsing, and the action returns the process exit code.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace efdl::cli {

class CommandRunner {
 public:
  void Set(std::function<int()> action) { action_ = std::move(action); }
  int Run() const { return action_ ? action_() : 2; }

 private:
  std::function<int()> action_;
};

// An option that also reads an environment variable, shown in --help as "(env: NAME)".
template <class T>
CLI::Option* OptionWithEnv(CLI::App* app, const std::string& name, T& value,
                           const std::string& help, const std::string& env) {
  return app->add_option(name, value, help)->envname(env);
}

void RegisterEtcdCommand(CLI::App& app, CommandRunner& runner);       // src/cli/etcd_command.cc
void RegisterSnapshotsCommand(CLI::App& app, CommandRunner& runner);  // src/cli/snapshots_command.cc
void RegisterPlanCommand(CLI::App& app, CommandRunner& runner);       // src/cli/plan_command.cc
void RegisterRunCommand(CLI::App& app, CommandRunner& runner);        // src/cli/run_command.cc
void RegisterStatusCommand(CLI::App& app, CommandRunner& runner);     // src/cli/status_command.cc
void RegisterEventsCommand(CLI::App& app, CommandRunner& runner);     // src/cli/status_command.cc
void RegisterSimCommand(CLI::App& app, CommandRunner& runner);        // src/cli/sim_command.cc
void RegisterSuspendCommand(CLI::App& app, CommandRunner& runner);    // src/cli/suspend_command.cc
void RegisterResumeCommand(CLI::App& app, CommandRunner& runner);     // src/cli/suspend_command.cc
void RegisterResetCommand(CLI::App& app, CommandRunner& runner);      // src/cli/reset_command.cc
void RegisterDashboardCommand(CLI::App& app, CommandRunner& runner);  // src/cli/dashboard_command.cc

}  // namespace efdl::cli
