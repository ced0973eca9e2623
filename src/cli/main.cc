// efdl: one command per node. See `efdl --help`.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cli/args_check.h"
#include "cli/commands.h"

#ifndef EFDL_VERSION
#define EFDL_VERSION "dev"
#endif

namespace {

// What CheckArgs needs to know of a (sub)command, read from its CLI11 definition.
efdl::cli::CommandSpec SpecOf(CLI::App& app, const std::string& path) {
  efdl::cli::CommandSpec spec;
  spec.path = path;
  for (const CLI::Option* o : app.get_options()) {
    if (!o->nonpositional()) {
      if (o->get_name() == "command") {
        spec.takes_command = true;
      } else {
        spec.takes_positionals = true;
      }
      continue;
    }
    efdl::cli::OptionSpec option;
    for (const std::string& n : o->get_lnames()) option.names.push_back("--" + n);
    for (const std::string& n : o->get_snames()) option.names.push_back("-" + n);
    option.takes_value = o->get_items_expected_max() > 0;  // a flag expects 0 items
    spec.options.push_back(std::move(option));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    spec.subcommand_names.push_back(sub->get_name());
    spec.subcommands.push_back(SpecOf(*sub, path + " " + sub->get_name()));
  }
  return spec;
}

}  // namespace

int main(int argc, char** argv) {
  // The name is what usage lines start with ("Usage: efdl run [OPTIONS] ...").
  CLI::App app{"EFDL: elastic and fault-tolerant training for PyTorch and Horovod jobs", "efdl"};
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
  efdl::cli::RegisterEventsCommand(app, runner);
  efdl::cli::RegisterSimCommand(app, runner);
  efdl::cli::RegisterSuspendCommand(app, runner);
  efdl::cli::RegisterResumeCommand(app, runner);
  efdl::cli::RegisterResetCommand(app, runner);
  efdl::cli::RegisterDashboardCommand(app, runner);

  // Name a mistyped option or command as the user wrote it (CLI11 would list every word it
  // could not place, the training command's included), and take torchrun's spellings.
  auto checked = efdl::cli::CheckArgs(SpecOf(app, "efdl"),
                                      std::vector<std::string>(argv + 1, argv + argc));
  if (!checked.ok()) {
    std::fprintf(stderr, "%s\n", checked.status().message().c_str());
    return 2;
  }
  std::vector<std::string> args = std::move(checked).value();
  try {
    // CLI11 takes the arguments in reverse order.
    std::vector<std::string> reversed(args.rbegin(), args.rend());
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints the one-line reason; every usage error exits 2 (like the commands' own checks),
    // whatever CLI11's internal code for it is. --help and --version exit 0.
    return app.exit(e) == 0 ? 0 : 2;
  }
  return runner.Run();
}
