#include "snapshot/persist_settings.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "common/env_names.h"

namespace efdl::snapshot {

namespace {

using GetEnv = std::function<const char*(const char*)>;

// The value of `name` without surrounding ASCII blanks; empty when unset.
std::string Trimmed(const GetEnv& getenv, const char* name) {
  const char* raw = getenv(name);
  std::string_view s = raw != nullptr ? raw : "";
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

// Unset or blank: `fallback`; otherwise a decimal integer with an optional sign.
Result<int64_t> EnvInt(const GetEnv& getenv, const char* name, int64_t fallback) {
  const std::string value = Trimmed(getenv, name);
  if (value.empty()) return fallback;
  std::string_view digits = value;
  bool sign_ok = true;
  if (digits.front() == '+') {  // from_chars takes '-' only
    digits.remove_prefix(1);
    sign_ok = digits.empty() || digits.front() != '-';  // "+-5"
  }
  int64_t out = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
  const bool whole = sign_ok && end == digits.data() + digits.size();
  if (ec == std::errc::result_out_of_range && whole) {
    return Status::InvalidArgument(fmt::format(
        "environment variable {}='{}' is out of range; set it to a smaller whole number or "
        "unset it", name, value));
  }
  if (ec != std::errc() || !whole) {
    return Status::InvalidArgument(
        fmt::format("environment variable {}='{}' is not an integer; set it to a whole number "
                    "or unset it", name, value));
  }
  return out;
}

bool EnvOnWord(const GetEnv& getenv, const char* name) {
  std::string flag = Trimmed(getenv, name);
  std::transform(flag.begin(), flag.end(), flag.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return flag == "1" || flag == "true" || flag == "yes" || flag == "on";
}

}  // namespace

Result<PersistSettings> PersistSettingsFromEnvironment(const GetEnv& getenv,
                                                       std::string job_secret) {
  PersistSettings s;
  auto per_rank = EnvInt(getenv, envvar::kSnapshotPerRank, 0);
  if (!per_rank.ok()) return per_rank.status();
  s.per_rank = *per_rank != 0;
  auto keep = EnvInt(getenv, envvar::kSnapshotKeep, 2);
  if (!keep.ok()) return keep.status();
  if (*keep < 1) {
    return Status::InvalidArgument(fmt::format(
        "EFDL_SNAPSHOT_KEEP={} keeps no snapshot; set it to 1 or more", *keep));
  }
  s.keep = static_cast<int>(std::min<int64_t>(*keep, int64_t{1} << 20));
  auto interval = EnvInt(getenv, envvar::kPersistMinIntervalMs, 1000);
  if (!interval.ok()) return interval.status();
  // A year is as good as never (exits, stops and flushes persist at once) and keeps the sum with
  // a steady_clock time point far from overflowing.
  constexpr int64_t kYearMs = int64_t{365} * 24 * 3600 * 1000;
  s.min_interval = std::chrono::milliseconds(std::clamp<int64_t>(*interval, 0, kYearMs));
  if (EnvOnWord(getenv, envvar::kSnapshotHmac)) {
    if (job_secret.empty()) {
      return Status::InvalidArgument(
          "EFDL_SNAPSHOT_HMAC=1 needs the job's secret, which `efdl run` hands its agents (from "
          "etcd) and their workers (EFDL_JOB_SECRET); none was given here: run the job with "
          "`efdl run`, or unset EFDL_SNAPSHOT_HMAC");
    }
    s.hmac_key = std::move(job_secret);
  }
  return s;
}

}  // namespace efdl::snapshot
