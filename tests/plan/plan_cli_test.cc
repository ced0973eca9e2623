// Runs the real `efdl plan` binary (path from the build: EFDL_TEST_EFDL_BIN) and checks what a
// user or scheduler sees: output, exit codes 0 / 1 / 2, one-line errors.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/subprocess.h"

namespace efdl {
namespace {

struct CliRun {
  int exit_code = -1;
  std::string out;
  std::string err;
};

std::string Drain(int fd) {
  std::string s;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) s.append(buf, static_cast<size_t>(n));
  return s;
}

CliRun Plan(std::vector<std::string> args) {
  SpawnOptions o;
  o.argv = {EFDL_TEST_EFDL_BIN, "plan"};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.stdout_mode = SpawnOptions::Stdio::kPipe;
  o.stderr_mode = SpawnOptions::Stdio::kFile;
  char path[] = "/tmp/efdl-plan-cli-XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  o.stderr_path = path;
  CliRun r;
  auto p = Subprocess::Spawn(o);
  if (!p.ok()) {
    ::unlink(path);
    ADD_FAILURE() << p.status().ToString();
    return r;
  }
  r.out = Drain(p->stdout_fd());
  auto st = p->WaitFor(std::chrono::seconds(30));
  if (!st) st = p->Stop(std::chrono::milliseconds(100));
  if (WIFEXITED(*st)) r.exit_code = WEXITSTATUS(*st);
  int efd = ::open(path, O_RDONLY | O_CLOEXEC);
  r.err = Drain(efd);
  ::close(efd);
  ::unlink(path);
  return r;
}

TEST(PlanCliTest, PrintsThePlacement) {
  CliRun r = Plan({"--procs", "8", "--free", "host1:3,host2:6,host3:5", "--max-parts", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            "placement for 8 processes in 2 parts:\n"
            "  host1  3 processes  (fills its 3 free GPUs)\n"
            "  host3  5 processes  (fills its 5 free GPUs)\n"
            "free GPUs left: host1 0, host2 6, host3 0\n");
  EXPECT_EQ(r.err, "");
  r = Plan({"--procs", "4", "--free", "a:6,b:7"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("  a  4 processes  (of 6 free GPUs, 2 stay free)\n"), std::string::npos)
      << r.out;
  r = Plan({"--procs", "3", "--free", "a:1,b:2", "--max-parts", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("(fills its 1 free GPU)\n"), std::string::npos) << r.out;
}

TEST(PlanCliTest, JsonForSchedulers) {
  CliRun r = Plan({"--procs", "8", "--free", "host1:3,host2:6,host3:5", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["procs"], 8);
  ASSERT_EQ(j["parts"].size(), 2u);
  EXPECT_EQ(j["parts"][0]["host"], "host1");
  EXPECT_EQ(j["parts"][0]["procs"], 3);
  EXPECT_EQ(j["parts"][1]["host"], "host3");
  EXPECT_EQ(j["leftover"][1]["free"], 6);
  EXPECT_EQ(j["proven_best"], true);

  r = Plan({"--procs", "9", "--free", "a:4,b:4", "--json"});
  EXPECT_EQ(r.exit_code, 1);
  j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j["parts"].is_null());
  EXPECT_NE(j["reason"].get<std::string>().find("only 8 free GPUs"), std::string::npos);
}

TEST(PlanCliTest, NoPlacementExitsOne) {
  CliRun r = Plan({"--procs", "8", "--free", "host1:3,host2:4,host3:1", "--max-parts", "2"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out,
            "no placement: need 8 processes in at most 2 parts, but the 2 hosts with the most "
            "free GPUs give only 7 (host2 4 + host1 3); 3 parts would be needed\n");
}

TEST(PlanCliTest, BadInputIsOneLineAndExitTwo) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  std::vector<Case> cases = {
      {{"--procs", "0", "--free", "a:1"}, "--procs '0'"},
      {{"--procs", "x", "--free", "a:1"}, "--procs 'x'"},
      {{"--procs", "2", "--free", "a:1,a:1"}, "'a' twice"},
      {{"--procs", "2", "--free", "a=1"}, "no ':'"},
      {{"--procs", "2", "--free", "a:1,,b:1"}, "empty entry"},
      {{"--procs", "2", "--free", "a:two"}, "'two' is not a free GPU count"},
      {{"--procs", "2", "--free", "a:2", "--max-parts", "0"}, "--max-parts '0'"},
  };
  for (const auto& c : cases) {
    CliRun r = Plan(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.says;
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(r.err.rfind("efdl plan: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace efdl
