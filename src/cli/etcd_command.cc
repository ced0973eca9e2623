// `efdl etcd`: a single-member etcd in the foreground, for running several agents on one
// machine. Prints the endpoint to use; SIGINT/SIGTERM stop etcd cleanly.
// Exit codes: 0 stopped on request, 1 etcd failed (start-up or later), 2 bad input.
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "common/net.h"
#include "efdl/embedded_etcd.h"
#include "etcd/private_dirs.h"

namespace efdl::cli {

namespace {

struct EtcdArgs {
  int port = 2379;
  int peer_port = 0;
  std::string data_dir;
  std::string host = "127.0.0.1";
};

int Fail(int code, const std::string& message) {
  std::fprintf(stderr, "efdl etcd: %s\n", message.c_str());
  return code;
}

int RunEtcd(const EtcdArgs& args) {
  if (args.port < 0 || args.port > 65535 || args.peer_port < 0 || args.peer_port > 65535) {
    return Fail(2, "--port and --peer-port must be from 0 (any free port) to 65535");
  }
  if (args.port != 0 && TcpConnectable(args.host, static_cast<uint16_t>(args.port), 200)) {
    return Fail(2, "port " + std::to_string(args.port) + " on " + args.host +
                       " is in use (another etcd?); pick another with --port, or 0 for any "
                       "free port");
  }
  // Block the stop signals before any thread exists (etcd's start-up check starts gRPC
  // threads), so every thread inherits the mask and only sigtimedwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // Private etcd directories of commands that were killed along with their reaper (#38).
  if (args.data_dir.empty()) etcd::RemoveStalePrivateEtcdDirs(etcd::TempBase());
  EmbeddedEtcdOptions options;
  options.host = args.host;
  options.client_port = static_cast<uint16_t>(args.port);
  options.peer_port = static_cast<uint16_t>(args.peer_port);
  options.data_dir = args.data_dir;
  auto etcd = EmbeddedEtcd::Start(options);
  if (!etcd.ok()) return Fail(1, etcd.status().message());

  const std::string endpoint = (*etcd)->endpoint();
  std::printf("etcd serving on %s (data: %s%s, log: %s)\n", endpoint.c_str(),
              (*etcd)->data_dir().c_str(), args.data_dir.empty() ? ", removed at exit" : "",
              (*etcd)->log_path().c_str());
  std::printf("EFDL_ETCD_ENDPOINTS=%s\n", endpoint.c_str());
  std::printf("Use it from other shells: export EFDL_ETCD_ENDPOINTS=%s (or efdl run --etcd %s). "
              "Ctrl-C stops it.\n",
              endpoint.c_str(), endpoint.c_str());
  std::fflush(stdout);

  while (true) {
    timespec tick{1, 0};
    int sig = sigtimedwait(&stop_signals, nullptr, &tick);
    if (sig > 0) {
      std::fprintf(stderr, "efdl etcd: stopping (%s)\n", strsignal(sig));
      Status stopped = (*etcd)->Stop();
      if (!stopped.ok()) return Fail(1, stopped.message());
      return 0;
    }
    if (sig < 0 && errno != EAGAIN && errno != EINTR) return Fail(1, "sigtimedwait failed");
    if (!(*etcd)->running()) {
      return Fail(1, "etcd exited unexpectedly; see " + (*etcd)->log_path());
    }
  }
}

}  // namespace

void RegisterEtcdCommand(CLI::App& app, CommandRunner& runner) {
  auto args = std::make_shared<EtcdArgs>();
  CLI::App* cmd = app.add_subcommand(
      "etcd", "Run a single-member etcd in the foreground and print the endpoint to use");
  cmd->add_option("--port", args->port, "client port (0: any free port)")
      ->capture_default_str();
  cmd->add_option("--peer-port", args->peer_port, "peer port (0: any free port)")
      ->capture_default_str();
  cmd->add_option("--data-dir", args->data_dir,
                  "data directory, kept after exit (default: a temporary one, removed at exit)");
  cmd->add_option("--host", args->host, "address to listen on and advertise")
      ->capture_default_str();
  cmd->callback([&runner, args] { runner.Set([args] { return RunEtcd(*args); }); });
}

}  // namespace efdl::cli
