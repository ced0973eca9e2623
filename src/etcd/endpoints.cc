// Parsing of "host:port[,host:port...]" endpoint lists.
#include <fmt/format.h>

#include <charconv>
#include <string_view>

#include "efdl/etcd.h"

namespace efdl::etcd {

namespace {

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

Result<std::string> ParseOne(std::string_view item, const std::string& spec) {
  const std::string hint = "expected host:port, e.g. 127.0.0.1:2379";
  std::string_view s = Trim(item);
  if (s.empty()) {
    return Status::InvalidArgument(fmt::format(
        "etcd endpoint list '{}' has an empty entry; {} (comma-separated)", spec, hint));
  }
  if (s.starts_with("https://")) {
    return Status::InvalidArgument(fmt::format(
        "etcd endpoint '{}': give it as host:port; TLS is turned on by --etcd-cacert (and "
        "--etcd-cert/--etcd-key for client certificates)", s));
  }
  if (s.starts_with("http://")) s.remove_prefix(7);
  if (!s.empty() && s.back() == '/') s.remove_suffix(1);
  std::string_view host;
  std::string_view port;
  if (s.starts_with("[")) {  // [IPv6]:port
    size_t close = s.find(']');
    if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      return Status::InvalidArgument(
          fmt::format("etcd endpoint '{}' is malformed; expected [ipv6]:port", item));
    }
    host = s.substr(0, close + 1);
    port = s.substr(close + 2);
  } else {
    size_t colon = s.rfind(':');
    if (colon == std::string_view::npos) {
      return Status::InvalidArgument(
          fmt::format("etcd endpoint '{}' has no port; {}", Trim(item), hint));
    }
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) {
      return Status::InvalidArgument(fmt::format(
          "etcd endpoint '{}' is malformed; write IPv6 addresses as [addr]:port", Trim(item)));
    }
  }
  if (host.empty() || host == "[]") {
    return Status::InvalidArgument(
        fmt::format("etcd endpoint '{}' has no host; {}", Trim(item), hint));
  }
  for (char c : host) {
    if (c == '/' || c == ' ' || c == '@' || c == '?' || c == '#') {
      return Status::InvalidArgument(
          fmt::format("etcd endpoint '{}' has an invalid host '{}'; {}", Trim(item), host, hint));
    }
  }
  unsigned value = 0;
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || value == 0 ||
      value > 65535) {
    return Status::InvalidArgument(fmt::format(
        "etcd endpoint '{}' has an invalid port '{}'; use a number from 1 to 65535", Trim(item),
        port));
  }
  return fmt::format("{}:{}", host, value);
}

}  // namespace

Result<std::vector<std::string>> ParseEndpoints(const std::string& spec) {
  if (Trim(spec).empty()) {
    return Status::InvalidArgument(
        "no etcd endpoints given; pass host:port[,host:port...], e.g. 127.0.0.1:2379");
  }
  std::vector<std::string> out;
  std::string_view rest = spec;
  while (true) {
    size_t comma = rest.find(',');
    EFDL_ASSIGN_OR_RETURN(std::string endpoint, ParseOne(rest.substr(0, comma), spec));
    out.push_back(std::move(endpoint));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return out;
}

}  // namespace efdl::etcd
