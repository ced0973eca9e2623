// A GoogleTest fixture whose every test starts with a fresh temporary directory `dir_`, removed
// with everything in it when the fixture is destroyed (after the derived fixture's own members).
// A derived fixture names its directory's prefix and sets up the rest in SetUpInDir (not
// reached when the directory could not be made).
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "common/net.h"

namespace efdl {

class TempDirTest : public ::testing::Test {
 protected:
  explicit TempDirTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    auto dir = TempDir::Create(prefix_);
    ASSERT_TRUE(dir.ok());
    dir_ = std::move(dir).value();
    SetUpInDir();
  }
  // What a derived fixture sets up once dir_ exists (nothing by default).
  virtual void SetUpInDir() {}

  TempDir dir_;

 private:
  std::string prefix_;
};

}  // namespace efdl
