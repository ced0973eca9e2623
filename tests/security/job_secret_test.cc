// The job secret: made once per job in etcd by whichever agent comes first, the same for all,
// different between jobs, and handed to workers as EFDL_JOB_SECRET.
#include <gtest/gtest.h>

#include <future>
#include <set>
#include <thread>
#include <vector>

#include "agent/agent.h"
#include "efdl/embedded_etcd.h"
#include "efdl/etcd.h"
#include "security/job_secret.h"

namespace efdl::security {
namespace {

TEST(JobSecretTest, ConcurrentAgentsAgreeOnOneSecretPerJobAndWorkersGetIt) {
  auto etcd = EmbeddedEtcd::Start({});
  ASSERT_TRUE(etcd.ok()) << etcd.status().ToString();
  etcd::ClientOptions options;
  options.endpoints = {(*etcd)->endpoint()};

  // Four agents of job "a" start at once, each with its own client (as separate processes).
  std::vector<std::future<Result<std::string>>> agents;
  for (int i = 0; i < 4; ++i) {
    agents.push_back(std::async(std::launch::async, [&]() -> Result<std::string> {
      EFDL_ASSIGN_OR_RETURN(auto client, etcd::Connect(options));
      return EnsureJobSecret(*client, "a");
    }));
  }
  std::set<std::string> seen;
  for (auto& f : agents) {
    auto secret = f.get();
    ASSERT_TRUE(secret.ok()) << secret.status().ToString();
    EXPECT_TRUE(IsValidSecret(*secret)) << secret->size();
    seen.insert(*secret);
  }
  ASSERT_EQ(seen.size(), 1u) << "every agent of a job must get the same secret";
  const std::string job_a = *seen.begin();

  auto client = etcd::Connect(options);
  ASSERT_TRUE(client.ok());
  auto job_b = EnsureJobSecret(**client, "b");
  ASSERT_TRUE(job_b.ok());
  EXPECT_NE(*job_b, job_a) << "each job has its own secret";
  auto stored = (*client)->Get(JobSecretKey("a"));
  ASSERT_TRUE(stored.ok() && stored->has_value());
  EXPECT_EQ((*stored)->value, job_a);

  agent::AgentOptions agent_options;
  agent_options.job_id = "a";
  agent_options.job_secret = job_a;
  rdzv::Assignment assignment;
  auto env = agent::WorkerEnvironment(agent_options, assignment, 0, 0, "/tmp/control.sock");
  EXPECT_EQ(env["EFDL_JOB_SECRET"], job_a);

  // Something else wrote the key: a clear error naming it, not a weak secret.
  ASSERT_TRUE((*client)->Put(JobSecretKey("c"), "password").ok());
  auto bad = EnsureJobSecret(**client, "c");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("/efdl/c/secret"), std::string::npos)
      << bad.status().message();
  EXPECT_NE(bad.status().message().find("delete it"), std::string::npos);
}

TEST(JobSecretTest, FreshSecretsAreHexAndDistinct) {
  std::set<std::string> secrets;
  for (int i = 0; i < 64; ++i) {
    auto s = NewSecret();
    ASSERT_TRUE(s.ok());
    EXPECT_TRUE(IsValidSecret(*s));
    secrets.insert(*s);
  }
  EXPECT_EQ(secrets.size(), 64u);
  EXPECT_FALSE(IsValidSecret(std::string(64, 'G')));
  EXPECT_FALSE(IsValidSecret(std::string(63, 'a')));
}

}  // namespace
}  // namespace efdl::security
