// `efdl plan`: where to run a job of N processes given the free GPUs per host.
// Exit codes: 0 a placement was printed, 1 no placement exists, 2 bad input.
#include <charconv>
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "plan/format.h"
#include "plan/planner.h"

namespace efdl::cli {

namespace {

struct PlanArgs {
  std::string procs;
  std::string free;
  std::string max_parts;
  bool json = false;
};

// A whole number >= 1 or an error line naming the option.
Result<int> PositiveInt(const std::string& text, const char* option, const char* what) {
  int v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < 1) {
    return Status::InvalidArgument(
        std::string(option) + " '" + text + "' is not " + what + " (a whole number >= 1)");
  }
  return v;
}

int RunPlan(const PlanArgs& args) {
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "efdl plan: %s\n", s.message().c_str());
    return 2;
  };
  auto procs = PositiveInt(args.procs, "--procs", "a process count");
  if (!procs.ok()) return fail(procs.status());
  int max_parts = 0;
  if (!args.max_parts.empty()) {
    auto m = PositiveInt(args.max_parts, "--max-parts", "a part count");
    if (!m.ok()) return fail(m.status());
    max_parts = *m;
  }
  auto hosts = plan::ParseFreeList(args.free);
  if (!hosts.ok()) return fail(hosts.status());
  auto placement = plan::PlanPlacement({*procs, *hosts, max_parts});
  if (!placement.ok() && !placement.status().IsFailedPrecondition()) {
    return fail(placement.status());
  }
  std::string out = args.json ? plan::FormatPlacementJson(*procs, placement)
                              : plan::FormatPlacementText(placement);
  std::fputs(out.c_str(), stdout);
  return placement.ok() ? 0 : 1;
}

}  // namespace

void RegisterPlanCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Place a job of N processes on hosts with free GPUs: fewest parts first, then the least "
      "leftover fragmentation (exit 0: placed, 1: no placement, 2: bad input)");
  cmd->add_option("--procs", args->procs, "processes (GPUs) the job needs")
      ->type_name("N")
      ->required();
  cmd->add_option("--free", args->free, "free GPUs per host, e.g. host1:3,host2:6,host3:5")
      ->type_name("HOST:GPUS,...")
      ->required();
  cmd->add_option("--max-parts", args->max_parts, "at most this many hosts (default: no limit)")
      ->type_name("M");
  cmd->add_flag("--json", args->json, "print one JSON object instead of text");
  cmd->callback([args, &runner] { runner.Set([args] { return RunPlan(*args); }); });
}

}  // namespace efdl::cli
