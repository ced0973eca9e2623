#include "agent/learned_imports.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include <nlohmann/json.hpp>

#include "agent/zygote.h"

namespace efdl::agent {

std::vector<std::string> TakeImportReports(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (!IsImportReportName(f)) continue;
    std::ifstream in(e.path());
    auto list = nlohmann::json::parse(in, nullptr, false);
    in.close();
    std::filesystem::remove(e.path(), ec);
    if (!list.is_array()) continue;
    for (const auto& n : list) {
      if (n.is_string()) names.push_back(n.get<std::string>());
    }
  }
  return names;
}

void LearnedImports::Read(Clock::time_point now) {
  if (dir_.empty() || off_ || now < next_scan_) return;
  next_scan_ = now + kScanInterval;
  for (auto& name : TakeImportReports(dir_)) {
    if (seen_.insert(name).second) names_.push_back(std::move(name));
  }
}

std::vector<std::string> LearnedImports::Unsent() const {
  if (off_ || sent_ >= names_.size()) return {};
  return {names_.begin() + static_cast<std::ptrdiff_t>(sent_), names_.end()};
}

double LearnedImports::Answered(Clock::time_point now) {
  const double took = sent_at_ ? std::chrono::duration<double>(now - *sent_at_).count() : 0.0;
  sent_at_.reset();
  return took;
}

}  // namespace efdl::agent
