// What a job leaves on a node is for the job's user only: the agent's control socket (0600, in
// a 0700 directory), shared-memory arenas and snapshot files (0600) and the snapshot
// directories EFDL creates (0700). Checked by mode, and as root also by trying as "nobody"
// from a parent directory that lets everyone through, so the modes alone must stop them.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <vector>

#include "agent/control_server.h"
#include "common/net.h"
#include "efdl/snapshot.h"

namespace efdl {
namespace {

constexpr uid_t kNobody = 65534;

mode_t ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path << ": " << std::strerror(errno);
  return st.st_mode & 07777;
}

// The cross-user checks act as "nobody", which only root can: without root a test checks the
// modes, then skips the rest with this reason (never passes them silently).
constexpr const char* kNeedsRoot =
    "the modes were checked; trying as another user needs root (run the test as root)";

// Runs `attempt` as uid/gid nobody in a child (the caller is root); returns the errno it
// reports (0: it succeeded).
int ErrnoAsNobody(const std::function<int()>& attempt) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) {
      ::_exit(250);
    }
    ::_exit(attempt());
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 250) << "could not become nobody";
  return WEXITSTATUS(status);
}

// As nobody, `attempt` must fail with EACCES (`what` it would have done names the failure).
void ExpectDeniedAsNobody(const std::function<int()>& attempt, const std::string& what) {
  const int err = ErrnoAsNobody(attempt);
  EXPECT_EQ(err, EACCES) << "another user " << what;
}

int TryOpen(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  ::close(fd);
  return 0;
}

int TryConnect(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = rc == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

TEST(PermissionsTest, ControlSocketIsOwnerOnlyInAPrivateDirectory) {
  // The agent's default: control.sock in a fresh TempDir.
  auto private_dir = TempDir::Create("efdl-agent");
  ASSERT_TRUE(private_dir.ok());
  EXPECT_EQ(ModeOf(private_dir->path()), 0700u);
  const std::string in_private = private_dir->path() + "/control.sock";
  auto server = agent::ControlServer::Start({in_private, "job", "node"});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  EXPECT_EQ(ModeOf(in_private) & 0777, 0600u);

  // A socket placed by --control-socket in a directory anyone may enter: its own mode stops
  // other users.
  auto open_dir = TempDir::Create("efdl-open");
  ASSERT_TRUE(open_dir.ok());
  ASSERT_EQ(::chmod(open_dir->path().c_str(), 0755), 0);
  const std::string in_open = open_dir->path() + "/control.sock";
  auto server2 = agent::ControlServer::Start({in_open, "job", "node"});
  ASSERT_TRUE(server2.ok()) << server2.status().ToString();
  EXPECT_EQ(ModeOf(in_open) & 0777, 0600u);
  EXPECT_EQ(TryConnect(in_open), 0) << "the owner must still connect";
  if (::geteuid() != 0) GTEST_SKIP() << kNeedsRoot;
  ExpectDeniedAsNobody([&] { return TryConnect(in_private); },
                       "connected to the control socket");
  ExpectDeniedAsNobody([&] { return TryConnect(in_open); }, "connected to the control socket");
}

TEST(PermissionsTest, ArenasSnapshotFilesAndJobDirectoriesAreOwnerOnly) {
  auto root = TempDir::Create("efdl-perm");
  ASSERT_TRUE(root.ok());
  // A shared parent (like /dev/shm or a team's storage mount): anyone may enter it.
  ASSERT_EQ(::chmod(root->path().c_str(), 0755), 0);
  const std::string job_dir = root->path() + "/snapshots/jobA";
  const std::string arena = root->path() + "/efdl-jobA-n0-node.arena";

  snapshot::EngineOptions o;
  o.job_id = "jobA";
  o.arena_path = arena;
  o.storage_dir = job_dir;
  auto engine = snapshot::SnapshotEngine::Open(o);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  std::vector<float> w(1000, 2.0f);
  ASSERT_TRUE((*engine)
                  ->SetLayout({{"w", "float32", {1000}, 0, w.size() * sizeof(float)}})
                  .ok());
  ASSERT_TRUE((*engine)->Commit({{w.data()}}, 1, "{}").ok());
  ASSERT_TRUE((*engine)->Flush(std::chrono::seconds(30)).ok());

  EXPECT_EQ(ModeOf(arena) & 0777, 0600u);
  EXPECT_EQ(ModeOf(root->path() + "/snapshots") & 0777, 0700u);
  EXPECT_EQ(ModeOf(job_dir) & 0777, 0700u);
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(job_dir)) {
    if (e.is_regular_file()) files.push_back(e.path().string());
  }
  ASSERT_FALSE(files.empty());
  for (const auto& f : files) EXPECT_EQ(ModeOf(f) & 0777, 0600u) << f;

  // Another user can neither read nor overwrite the arena, nor enter the job's directory.
  if (::geteuid() != 0) GTEST_SKIP() << kNeedsRoot;
  ExpectDeniedAsNobody([&] { return TryOpen(arena, O_RDONLY); }, "read the arena");
  ExpectDeniedAsNobody([&] { return TryOpen(arena, O_WRONLY); }, "could overwrite the arena");
  ExpectDeniedAsNobody([&] { return TryOpen(files[0], O_RDONLY); }, "read a snapshot");
  ExpectDeniedAsNobody([&] { return TryOpen(job_dir + "/planted", O_WRONLY | O_CREAT); },
                       "planted a file in the job's directory");
}

}  // namespace
}  // namespace efdl
