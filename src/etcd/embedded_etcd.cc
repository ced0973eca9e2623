#include "efdl/embedded_etcd.h"

#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/group_reaper.h"
#include "common/log.h"
#include "common/net.h"
#include "common/subprocess.h"
#include "etcd/grpc_client.h"
#include "etcd/private_dirs.h"

namespace efdl {

namespace {

// The last non-empty line of etcd's log, to put the reason into an error message.
std::string LastLogLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::string last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  if (last.size() > 300) last = last.substr(0, 300) + "...";
  return last;
}

bool LogSaysAddressInUse(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find("address already in use") != std::string::npos) return true;
  }
  return false;
}

}  // namespace

struct EmbeddedEtcd::Impl {
  // With a temporary data directory: removes it (and kills etcd) should this process die
  // without doing it. Declared first: it outlives the directory and the process.
  std::unique_ptr<GroupReaper> reaper;
  TempDir temp_dir;  // set when we made the data directory
  Subprocess process;

  ~Impl() {
    process = Subprocess();   // killed and reaped (a no-op after Stop)
    if (!temp_dir.path().empty()) {
      const std::string path = temp_dir.path();
      { TempDir gone = std::move(temp_dir); }   // removes it
      if (reaper) (void)reaper->RemoveDirectory(path);
    }
  }
};

namespace {

// etcd settings of a private (temporary) etcd that keep it small. etcd 3.4 preallocates each
// 64 MB write-ahead-log segment and the next one (123 MB at start, fixed in 3.4); these bound the
// growth beyond that: a raft snapshot every 10000 writes (etcd's default before 3.2; 3.4's is
// 100000, held in memory too) lets etcd release old log segments, and at most 2 released segments
// and 2 snapshot files are kept (defaults 5 and 5). docs/operations.md, "Private etcd".
// --backend-batch-interval 10ms (default 100 ms): etcd 3.4 copies every write not yet committed
// to its bbolt backend on each read of the current revision, which it does for every watch
// create and cancel and every keep-alive answer; committing every 10 ms instead of 100 ms keeps
// that copy ten times shorter (a 2,000-node `efdl sim` run: etcd CPU 10.0 s -> 6.6 s, issue #37,
// docs/scale.md section 6). Durability is the write-ahead log's, which is synced before every
// answer either way; the interval only says how often applied writes move into bbolt.
const std::vector<std::string> kPrivateEtcdArgs = {"--snapshot-count", "10000", "--max-wals", "2",
                                                   "--max-snapshots", "2",
                                                   "--backend-batch-interval", "10ms"};
// Go's GOGC for a private etcd unless the caller's environment sets one. That copy (512 entries
// of each written bucket at least, whatever it holds: tens of KB per answer, fixed upstream in
// etcd 3.5) is garbage at once, and collecting it was about 40 % of etcd's CPU in a profile of a
// 10,000-node formation (`ETCD_ENABLE_PPROF=true efdl sim`). Collecting at 5x the live heap
// instead of 2x roughly halved etcd's CPU there (15-17 -> 6.3-6.5 CPU-s, docs/scale.md section
// 3) for about twice the memory (145-155 -> 340-415 MiB at 10,000 nodes; a few MB for a small
// job, whose live heap is a few MB).
constexpr const char* kPrivateEtcdGoGc = "400";
constexpr const char* kGoDefaultGoGc = "100";   // Go's, when GOGC is not set

}  // namespace

EmbeddedEtcd::EmbeddedEtcd(EmbeddedEtcdOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>()) {}

EmbeddedEtcd::~EmbeddedEtcd() {
  Status s = Stop();
  if (!s.ok()) EFDL_LOG_WARN("embedded etcd: {}", s.ToString());
}

std::string EmbeddedEtcd::endpoint() const {
  return fmt::format("{}:{}", options_.host, client_port_);
}

std::string EmbeddedEtcd::log_path() const { return data_dir_ + "/etcd.log"; }

bool EmbeddedEtcd::running() {
  if (!impl_->process.running()) return false;
  return !impl_->process.Poll().has_value();
}

int EmbeddedEtcd::pid() const { return impl_->process.pid(); }

Result<std::unique_ptr<EmbeddedEtcd>> EmbeddedEtcd::Start(EmbeddedEtcdOptions options) {
  std::unique_ptr<EmbeddedEtcd> etcd(new EmbeddedEtcd(std::move(options)));
  const EmbeddedEtcdOptions& o = etcd->options_;
  if (o.data_dir.empty()) {
    // The reaper first: from the moment the directory exists it is removed however we die.
    if (auto reaper = GroupReaper::Start(); reaper.ok()) {
      etcd->impl_->reaper = std::move(reaper).value();
    } else {
      EFDL_LOG_WARN("{}: a SIGKILL of this process would leave the private etcd's directory "
                    "behind (the next efdl run, efdl sim or efdl snapshots gc removes it)",
                    reaper.status().message());
    }
    EFDL_ASSIGN_OR_RETURN(etcd->impl_->temp_dir, TempDir::Create(etcd::kPrivateDirPrefix));
    etcd->data_dir_ = etcd->impl_->temp_dir.path();
    if (etcd->impl_->reaper) {
      if (Status listed = etcd->impl_->reaper->AddDirectory(etcd->data_dir_); !listed.ok()) {
        EFDL_LOG_WARN("private etcd directory: {}", listed.message());
      }
    }
  } else {
    std::error_code ec;
    std::filesystem::create_directories(o.data_dir, ec);
    if (ec) {
      return Status::IOError(fmt::format("cannot create etcd data directory '{}': {}",
                                         o.data_dir, ec.message()));
    }
    etcd->data_dir_ = std::filesystem::absolute(o.data_dir).string();
  }
  const bool auto_ports = o.client_port == 0 || o.peer_port == 0;
  constexpr int kAttempts = 3;
  Status last;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    if (o.client_port == 0) {
      EFDL_ASSIGN_OR_RETURN(etcd->client_port_, PickFreePort(o.host));
    } else {
      etcd->client_port_ = o.client_port;
    }
    if (o.peer_port == 0) {
      do {
        EFDL_ASSIGN_OR_RETURN(etcd->peer_port_, PickFreePort(o.host));
      } while (etcd->peer_port_ == etcd->client_port_);
    } else {
      etcd->peer_port_ = o.peer_port;
    }
    std::filesystem::remove(etcd->log_path());  // a fresh log: errors quote this run's output
    last = etcd->Launch(o.wait_until_healthy);
    if (last.ok()) {
      // Written once etcd holds its database's lock: from then on a sweep that cannot see the
      // owner process (another pid namespace) still sees the lock (etcd/private_dirs.h).
      if (!etcd->impl_->temp_dir.path().empty()) {
        if (Status owned = etcd::WriteOwnerFile(etcd->data_dir_); !owned.ok()) {
          EFDL_LOG_WARN("private etcd directory: {}", owned.message());
        }
      }
      return etcd;
    }
    // Someone took a port we picked a moment ago: pick again.
    if (!auto_ports || !LogSaysAddressInUse(etcd->log_path())) break;
    EFDL_LOG_INFO("embedded etcd: port taken, retrying with other ports");
  }
  return last;
}

Status EmbeddedEtcd::Launch(bool wait) {
  EFDL_ASSIGN_OR_RETURN(std::string binary, FindProgram(options_.binary));
  const bool tls = !options_.cert_file.empty();
  const std::string client_url =
      fmt::format("{}://{}:{}", tls ? "https" : "http", options_.host, client_port_);
  const std::string peer_url = fmt::format("http://{}:{}", options_.host, peer_port_);
  SpawnOptions spawn;
  spawn.argv = {binary,
                "--name", options_.name,
                "--data-dir", data_dir_ + "/member-data",
                "--listen-client-urls", client_url,
                "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url,
                "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster",
                options_.initial_cluster.empty() ? fmt::format("{}={}", options_.name, peer_url)
                                                 : options_.initial_cluster,
                "--initial-cluster-state", "new",
                "--logger", "zap",
                "--log-outputs", "stderr"};
  if (tls) {
    spawn.argv.insert(spawn.argv.end(),
                      {"--cert-file", options_.cert_file, "--key-file", options_.key_file});
    if (!options_.trusted_ca_file.empty()) {
      spawn.argv.insert(spawn.argv.end(), {"--client-cert-auth", "--trusted-ca-file",
                                           options_.trusted_ca_file});
    }
  }
  const bool private_etcd = !impl_->temp_dir.path().empty();
  if (private_etcd) {
    spawn.argv.insert(spawn.argv.end(), kPrivateEtcdArgs.begin(), kPrivateEtcdArgs.end());
  }
  // etcd inherits the caller's GOGC; a private etcd gets kPrivateEtcdGoGc when there is none.
  const char* callers = std::getenv("GOGC");
  const bool caller_set = callers != nullptr && *callers != '\0';
  go_gc_ = caller_set ? callers : private_etcd ? kPrivateEtcdGoGc : kGoDefaultGoGc;
  if (private_etcd && !caller_set) spawn.env_set["GOGC"] = go_gc_;
  spawn.argv.insert(spawn.argv.end(), options_.extra_args.begin(), options_.extra_args.end());
  // Debian's etcd reads ETCD_* variables too; keep the caller's from changing our setup.
  for (const char* var : {"ETCD_NAME", "ETCD_DATA_DIR", "ETCD_LISTEN_CLIENT_URLS",
                          "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_INITIAL_CLUSTER",
                          "ETCD_LISTEN_PEER_URLS", "ETCD_INITIAL_ADVERTISE_PEER_URLS",
                          "ETCD_INITIAL_CLUSTER_STATE"}) {
    spawn.env_unset.push_back(var);
  }
  spawn.stdout_mode = SpawnOptions::Stdio::kFile;
  spawn.stdout_path = log_path();
  spawn.stderr_to_stdout = true;
  spawn.reaper = impl_->reaper.get();   // its group is killed before the directory goes
  EFDL_ASSIGN_OR_RETURN(impl_->process, Subprocess::Spawn(spawn));
  if (!wait) return Status::OK();
  Status healthy = WaitUntilHealthy();
  if (!healthy.ok()) {
    impl_->process.Stop(std::chrono::seconds(2));
    return healthy;
  }
  EFDL_LOG_DEBUG("embedded etcd pid {} serving {} (data {})", impl_->process.pid(), endpoint(),
                 data_dir_);
  return Status::OK();
}

Status EmbeddedEtcd::WaitUntilHealthy() {
  const auto deadline = std::chrono::steady_clock::now() + options_.start_timeout;
  etcd::ClientOptions client_options;
  client_options.endpoints = {endpoint()};
  EFDL_ASSIGN_OR_RETURN(auto credentials, etcd::MakeChannelCredentials(options_.health_tls));
  etcd::GrpcClient client(client_options, client_options.endpoints, credentials);
  Status last_error = Status::Unavailable("nothing listens on the client port yet");
  while (true) {
    if (auto exited = impl_->process.Poll()) {
      return Status::Unavailable(fmt::format(
          "etcd {} during start-up ({}); see {}: {}", DescribeWaitStatus(*exited), endpoint(),
          log_path(), LastLogLine(log_path())));
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    if (TcpConnectable(options_.host, client_port_, 100)) {
      // A real request: the member has joined its one-member cluster and serves reads.
      auto revision = client.Ping(std::min(left, std::chrono::milliseconds(1000)));
      if (revision.ok()) return Status::OK();
      last_error = revision.status();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return Status::DeadlineExceeded(fmt::format(
      "etcd at {} did not become healthy within {} ms ({}); see {}: {}", endpoint(),
      options_.start_timeout.count(), last_error.message(), log_path(), LastLogLine(log_path())));
}

Status EmbeddedEtcd::Stop(std::chrono::milliseconds grace) {
  if (!impl_->process.running()) return Status::OK();
  int wait_status = impl_->process.Stop(grace);
  // SIGTERM is how we ask it to stop: exiting from it is a clean stop.
  if (!WaitStatusSuccess(wait_status) &&
      !(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGTERM)) {
    EFDL_LOG_DEBUG("embedded etcd at {} stopped: {}", endpoint(), DescribeWaitStatus(wait_status));
  }
  return Status::OK();
}

Status EmbeddedEtcd::Kill() {
  if (!impl_->process.running()) return Status::OK();
  EFDL_RETURN_IF_ERROR(impl_->process.Signal(SIGKILL));
  impl_->process.Wait();
  return Status::OK();
}

Status EmbeddedEtcd::Restart() {
  EFDL_RETURN_IF_ERROR(Stop());
  return Launch(/*wait=*/true);
}

Result<std::unique_ptr<EmbeddedEtcdCluster>> EmbeddedEtcdCluster::Start(
    int members, std::chrono::milliseconds start_timeout) {
  if (members < 1) {
    return Status::InvalidArgument(fmt::format("an etcd cluster needs at least 1 member, not {}",
                                               members));
  }
  // Every member must know every peer URL up front: pick all ports first.
  std::vector<EmbeddedEtcdOptions> options(static_cast<size_t>(members));
  std::string initial_cluster;
  std::vector<uint16_t> taken;
  auto fresh_port = [&]() -> Result<uint16_t> {
    while (true) {
      EFDL_ASSIGN_OR_RETURN(uint16_t port, PickFreePort("127.0.0.1"));
      if (std::find(taken.begin(), taken.end(), port) == taken.end()) {
        taken.push_back(port);
        return port;
      }
    }
  };
  for (int i = 0; i < members; ++i) {
    EmbeddedEtcdOptions& o = options[static_cast<size_t>(i)];
    o.name = fmt::format("efdl{}", i);
    EFDL_ASSIGN_OR_RETURN(o.client_port, fresh_port());
    EFDL_ASSIGN_OR_RETURN(o.peer_port, fresh_port());
    o.start_timeout = start_timeout;
    o.wait_until_healthy = false;
    if (!initial_cluster.empty()) initial_cluster += ",";
    initial_cluster += fmt::format("{}=http://{}:{}", o.name, o.host, o.peer_port);
  }
  std::unique_ptr<EmbeddedEtcdCluster> cluster(new EmbeddedEtcdCluster());
  for (EmbeddedEtcdOptions& o : options) {
    o.initial_cluster = initial_cluster;
    EFDL_ASSIGN_OR_RETURN(auto member, EmbeddedEtcd::Start(o));
    cluster->members_.push_back(std::move(member));
  }
  for (auto& member : cluster->members_) EFDL_RETURN_IF_ERROR(member->WaitUntilHealthy());
  return cluster;
}

std::string EmbeddedEtcdCluster::endpoints() const {
  std::string out;
  for (const auto& m : members_) out += (out.empty() ? "" : ",") + m->endpoint();
  return out;
}

}  // namespace efdl
