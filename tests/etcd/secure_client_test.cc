// The etcd client against a real etcd serving TLS with --client-cert-auth and user/password
// auth. Certificates are made at test time by secure_etcd_setup.sh (openssl), and users and
// roles are set up with etcdctl: a user "job" may read and write under /efdl/ only.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "common/net.h"
#include "common/subprocess.h"
#include "efdl/embedded_etcd.h"
#include "efdl/etcd.h"
#include "test_util.h"

namespace efdl::etcd {
namespace {

using namespace std::chrono_literals;
using testing::WaitUntil;

Status RunScript(const std::vector<std::string>& args) {
  SpawnOptions spawn;
  spawn.argv = {std::string(EFDL_SECURE_SETUP)};
  spawn.argv.insert(spawn.argv.end(), args.begin(), args.end());
  EFDL_ASSIGN_OR_RETURN(Subprocess child, Subprocess::Spawn(spawn));
  auto status = child.WaitFor(60s);
  if (!status) {
    child.Stop(1s);
    return Status::DeadlineExceeded("secure_etcd_setup.sh took over 60 s");
  }
  if (!WaitStatusSuccess(*status)) {
    return Status::Internal("secure_etcd_setup.sh " + args[0] + " " +
                            DescribeWaitStatus(*status));
  }
  return Status::OK();
}

// An etcd on loopback with TLS, client certificates and auth on; owns its certificate dir.
struct SecureEtcd {
  TempDir certs;
  std::unique_ptr<EmbeddedEtcd> etcd;

  std::string cert(const std::string& name) const { return certs.path() + "/" + name; }
  TlsOptions GoodTls() const {
    return {cert("ca.pem"), cert("client.pem"), cert("client-key.pem")};
  }
  ClientOptions JobOptions() const {
    ClientOptions o;
    o.endpoints = {etcd->endpoint()};
    o.tls = GoodTls();
    o.user = "job";
    o.password = "jobpw";
    o.connect_timeout = 5s;
    return o;
  }
};

// `token_ttl_s`: etcd's --auth-token-ttl (a short one makes tokens expire during a test).
std::unique_ptr<SecureEtcd> StartSecureEtcd(int token_ttl_s = 300) {
  auto s = std::make_unique<SecureEtcd>();
  auto dir = TempDir::Create("efdl-certs");
  EXPECT_TRUE(dir.ok());
  if (!dir.ok()) return nullptr;
  s->certs = std::move(dir).value();
  Status made = RunScript({"certs", s->certs.path()});
  EXPECT_TRUE(made.ok()) << made.ToString();
  if (!made.ok()) return nullptr;
  EmbeddedEtcdOptions o;
  o.cert_file = s->cert("server.pem");
  o.key_file = s->cert("server-key.pem");
  o.trusted_ca_file = s->cert("ca.pem");
  o.health_tls = s->GoodTls();
  o.extra_args = {"--auth-token-ttl", std::to_string(token_ttl_s)};
  auto etcd = EmbeddedEtcd::Start(o);
  EXPECT_TRUE(etcd.ok()) << etcd.status().ToString();
  if (!etcd.ok()) return nullptr;
  s->etcd = std::move(etcd).value();
  Status auth = RunScript({"auth", s->etcd->endpoint(), s->certs.path()});
  EXPECT_TRUE(auth.ok()) << auth.ToString();
  if (!auth.ok()) return nullptr;
  return s;
}

TEST(SecureEtcdTest, TlsWithAuthServesKvWatchLeasesAndRenewsExpiredTokens) {
  auto secure = StartSecureEtcd(/*token_ttl_s=*/2);
  ASSERT_NE(secure, nullptr);
  auto client = Connect(secure->JobOptions());
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  Client& c = **client;

  std::atomic<int> seen{0};
  auto watch = c.StartWatch("/efdl/job1/", {.prefix = true}, [&](const WatchUpdate& u) {
    for (const auto& e : u.events) {
      if (e.kv.key == "/efdl/job1/a") seen.fetch_add(1);
    }
  });
  ASSERT_TRUE(watch.ok()) << watch.status().ToString();

  ASSERT_TRUE(c.Put("/efdl/job1/a", "1").ok());
  auto got = c.Get("/efdl/job1/a");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_TRUE(got->has_value());
  EXPECT_EQ((*got)->value, "1");
  EXPECT_TRUE(WaitUntil([&] { return seen.load() == 1; }, 10s));

  auto lease = c.LeaseGrant(5);
  ASSERT_TRUE(lease.ok()) << lease.status().ToString();
  std::atomic<bool> lost{false};
  auto keeper = c.KeepAlive(lease->id, [&] { lost = true; });
  ASSERT_TRUE(keeper.ok()) << keeper.status().ToString();
  ASSERT_TRUE(c.Put("/efdl/job1/alive", "x", lease->id).ok());

  // Outside the role's prefix: refused, with the fix named.
  auto outside = c.Put("/other/a", "1");
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("permission denied"), std::string::npos)
      << outside.status().message();
  EXPECT_NE(outside.status().message().find("grant-permission"), std::string::npos);

  // Idle past the token's TTL (what is tested is the expiry itself, so this waits): etcd
  // forgets the token; the next calls authenticate again and succeed.
  std::this_thread::sleep_for(3500ms);
  auto after = c.Put("/efdl/job1/a", "2");
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_TRUE(WaitUntil([&] { return seen.load() == 2; }, 10s));
  auto ttl = c.LeaseTimeToLive(lease->id);
  ASSERT_TRUE(ttl.ok()) << ttl.status().ToString();
  EXPECT_FALSE(lost.load()) << "the lease was kept alive over TLS";
}

TEST(SecureEtcdTest, EachBadSettingGivesOneClearError) {
  auto secure = StartSecureEtcd();
  ASSERT_NE(secure, nullptr);
  auto expect_error = [&](ClientOptions o, const std::string& needle) {
    o.connect_timeout = 3s;
    auto client = Connect(o);
    ASSERT_FALSE(client.ok()) << "connected although: " << needle;
    const std::string& msg = client.status().message();
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line: " << msg;
    EXPECT_EQ(msg.find("jobpw"), std::string::npos) << "never the password: " << msg;
    EXPECT_EQ(msg.find("wrongpw"), std::string::npos) << "never the password: " << msg;
  };

  ClientOptions wrong_password = secure->JobOptions();
  wrong_password.password = "wrongpw";
  expect_error(wrong_password, "wrong user name or password");

  ClientOptions no_user = secure->JobOptions();
  no_user.user.clear();
  no_user.password.clear();
  // The client certificate's CN ("efdl-client") is no etcd user: etcd refuses the request.
  auto anonymous = Connect(no_user);
  if (anonymous.ok()) {
    auto put = (*anonymous)->Put("/efdl/x", "1");
    ASSERT_FALSE(put.ok()) << "an unauthenticated write succeeded";
  }

  ClientOptions no_client_cert = secure->JobOptions();
  no_client_cert.tls.cert_file.clear();
  no_client_cert.tls.key_file.clear();
  expect_error(no_client_cert, "refused our client certificate");

  ClientOptions wrong_ca = secure->JobOptions();
  wrong_ca.tls.ca_file = secure->cert("other-ca.pem");
  expect_error(wrong_ca, "not trusted");

  ClientOptions foreign_client_cert = secure->JobOptions();
  foreign_client_cert.tls.cert_file = secure->cert("other-client.pem");
  foreign_client_cert.tls.key_file = secure->cert("other-client-key.pem");
  expect_error(foreign_client_cert, "refused our client certificate");

  ClientOptions plaintext = secure->JobOptions();
  plaintext.tls = {};
  expect_error(plaintext, "--etcd-cacert");

  ClientOptions missing_file = secure->JobOptions();
  missing_file.tls.ca_file = secure->cert("nope.pem");
  expect_error(missing_file, "--etcd-cacert");

  ClientOptions half_pair = secure->JobOptions();
  half_pair.tls.key_file.clear();
  expect_error(half_pair, "--etcd-cert and --etcd-key go together");

  // TLS to a plaintext etcd.
  auto plain = EmbeddedEtcd::Start({});
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  ClientOptions tls_to_plain = secure->JobOptions();
  tls_to_plain.endpoints = {(*plain)->endpoint()};
  expect_error(tls_to_plain, "does not speak TLS");
}

}  // namespace
}  // namespace efdl::etcd
