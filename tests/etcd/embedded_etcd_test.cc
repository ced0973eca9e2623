// The settings of a private etcd (a temporary data directory, src/etcd/embedded_etcd.cc): the
// GOGC it runs with, read from the real etcd process' environment.
#include "efdl/embedded_etcd.h"

#include <stdlib.h>

#include <fstream>
#include <iterator>
#include <string>

#include <gtest/gtest.h>

namespace efdl {
namespace {

// GOGC=... from /proc/<pid>/environ ("" when it is not set there).
std::string GoGcOf(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  const std::string all{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  size_t at = 0;
  while (at < all.size()) {
    const size_t end = all.find('\0', at);
    const std::string var = all.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (var.rfind("GOGC=", 0) == 0) return var.substr(5);
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return "";
}

// The caller's GOGC for the length of a scope.
class ScopedGoGc {
 public:
  explicit ScopedGoGc(const char* value) {
    if (const char* old = ::getenv("GOGC")) old_ = old;
    if (value != nullptr) {
      ::setenv("GOGC", value, 1);
    } else {
      ::unsetenv("GOGC");
    }
  }
  ~ScopedGoGc() {
    if (old_.empty()) {
      ::unsetenv("GOGC");
    } else {
      ::setenv("GOGC", old_.c_str(), 1);
    }
  }

 private:
  std::string old_;
};

TEST(EmbeddedEtcdTest, APrivateEtcdCollectsGarbageAtGogc400UnlessTheCallerSetsGogc) {
  {
    ScopedGoGc none(nullptr);
    auto etcd = EmbeddedEtcd::Start({});
    ASSERT_TRUE(etcd.ok()) << etcd.status().ToString();
    EXPECT_EQ(GoGcOf((*etcd)->pid()), "400");
    EXPECT_EQ((*etcd)->go_gc(), "400");
  }
  {
    ScopedGoGc callers("150");
    auto etcd = EmbeddedEtcd::Start({});
    ASSERT_TRUE(etcd.ok()) << etcd.status().ToString();
    EXPECT_EQ(GoGcOf((*etcd)->pid()), "150") << "the caller's GOGC wins";
    EXPECT_EQ((*etcd)->go_gc(), "150");
  }
}

}  // namespace
}  // namespace efdl
