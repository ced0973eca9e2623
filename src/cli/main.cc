// efdl: one command per node. See `efdl --help`.
#include <CLI/CLI.hpp>

#include "cli/commands.h"

#ifndef EFDL_VERSION
#define EFDL_VERSION "dev"
#endif

int main(int argc, char** argv) {
  CLI::App app{"EFDL: elastic and fault-tolerant training for PyTorch and Horovod jobs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", EFDL_VERSION);
  efdl::cli::CommandRunner runner;
  // Every usage error is one line: what is wrong and where the options are listed.
  app.failure_message([](const CLI::App* failed, const CLI::Error& e) {
    std::string command = "efdl";
    for (const CLI::App* sub : failed->get_subcommands()) command += " " + sub->get_name();
    return "efdl: error: " + std::string(e.what()) + "; see `" + command + " --help`\n";
  });

  efdl::cli::RegisterEtcdCommand(app, runner);
  efdl::cli::RegisterSnapshotsCommand(app, runner);
  efdl::cli::RegisterPlanCommand(app, runner);
  efdl::cli::RegisterRunCommand(app, runner);
  efdl::cli::RegisterStatusCommand(app, runner);
  efdl::cli::RegisterSimCommand(app, runner);
  efdl::cli::RegisterSuspendCommand(app, runner);
  efdl::cli::RegisterResumeCommand(app, runner);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the one-line reason; every usage error exits 2 (like the commands' own checks),
    // whatever CLI11's internal code for it is. --help and --version exit 0.
    return app.exit(e) == 0 ? 0 : 2;
  }
  return runner.Run();
}
