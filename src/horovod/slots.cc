#include "horovod/slots.h"

#include <set>

#include <fmt/format.h>

#include "common/env_names.h"
#include "horovod/rendezvous_server.h"

namespace efdl::horovod {

std::string SlotInfo::ToResponseString() const {
  return fmt::format("{},{},{},{},{},{}", rank, size, local_rank, local_size, cross_rank,
                     cross_size);
}

SlotInfo RemovedSlot() { return SlotInfo{"", -1, -1, -1, -1, -1, -1}; }

Status ValidateHostname(const std::string& hostname) {
  if (hostname.empty()) {
    return Status::InvalidArgument("Horovod host name is empty: give every node a non-empty id");
  }
  if (hostname.size() > 253) {
    return Status::InvalidArgument(fmt::format(
        "Horovod host name '{}...' is longer than 253 characters: use a shorter node id",
        hostname.substr(0, 32)));
  }
  for (char c : hostname) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-';
    if (!ok) {
      return Status::InvalidArgument(fmt::format(
          "Horovod host name '{}' contains '{}': it becomes part of a URL path, so use only "
          "letters, digits, '.', '_' and '-'",
          hostname, c));
    }
  }
  return Status::OK();
}

Result<std::vector<SlotInfo>> AssignSlots(const std::vector<HostSlots>& hosts) {
  if (hosts.empty()) {
    return Status::InvalidArgument("a Horovod round needs at least one host");
  }
  std::set<std::string> seen;
  int world = 0;
  int max_slots = 0;
  for (const auto& h : hosts) {
    EFDL_RETURN_IF_ERROR(ValidateHostname(h.hostname));
    if (!seen.insert(h.hostname).second) {
      return Status::InvalidArgument(fmt::format(
          "host '{}' appears twice in the round: every node needs its own id", h.hostname));
    }
    if (h.slots < 1) {
      return Status::InvalidArgument(fmt::format(
          "host '{}' has {} slots: every host of a round runs at least one process", h.hostname,
          h.slots));
    }
    world += h.slots;
    max_slots = std::max(max_slots, h.slots);
  }
  // cross_size[i]: hosts with more than i processes; a host's cross rank at local rank i counts
  // the earlier hosts that also have a local rank i.
  std::vector<int> cross_size(static_cast<size_t>(max_slots), 0);
  for (const auto& h : hosts) {
    for (int i = 0; i < h.slots; ++i) ++cross_size[static_cast<size_t>(i)];
  }
  std::vector<int> cross_next(static_cast<size_t>(max_slots), 0);
  std::vector<SlotInfo> out;
  out.reserve(static_cast<size_t>(world));
  int rank = 0;
  for (const auto& h : hosts) {
    for (int i = 0; i < h.slots; ++i) {
      auto li = static_cast<size_t>(i);
      out.push_back(SlotInfo{h.hostname, rank++, world, i, h.slots, cross_next[li]++,
                             cross_size[li]});
    }
  }
  return out;
}

Result<std::vector<EnvMap>> WorkerEnvForHost(const std::vector<HostSlots>& hosts,
                                             size_t host_index, const WorkerEnvOptions& options) {
  if (host_index >= hosts.size()) {
    return Status::InvalidArgument(fmt::format(
        "host index {} is outside the round of {} hosts", host_index, hosts.size()));
  }
  if (options.rendezvous_addr.empty() || options.rendezvous_port == 0 ||
      options.rendezvous_token.empty()) {
    return Status::InvalidArgument(
        "the Horovod rendezvous address, port or token is not set: start the round's "
        "RendezvousServer first and pass its address, port and token");
  }
  EFDL_ASSIGN_OR_RETURN(std::vector<SlotInfo> slots, AssignSlots(hosts));
  const std::string& me = hosts[host_index].hostname;
  std::vector<EnvMap> out;
  for (const auto& s : slots) {
    if (s.hostname == me) out.push_back(WorkerEnv(s, options));
  }
  return out;
}

EnvMap WorkerEnv(const SlotInfo& s, const WorkerEnvOptions& options) {
  EnvMap env{
      {envvar::kHorovodHostname, s.hostname},
      {envvar::kHorovodRank, std::to_string(s.rank)},
      {envvar::kHorovodSize, std::to_string(s.size)},
      {envvar::kHorovodLocalRank, std::to_string(s.local_rank)},
      {envvar::kHorovodLocalSize, std::to_string(s.local_size)},
      {envvar::kHorovodCrossRank, std::to_string(s.cross_rank)},
      {envvar::kHorovodCrossSize, std::to_string(s.cross_size)},
      {envvar::kHorovodController, "gloo"},
      {envvar::kHorovodCpuOperations, "gloo"},
  };
  if (options.rendezvous_port != 0 && !options.rendezvous_token.empty()) {
    env[envvar::kHorovodGlooRendezvousAddr] = HorovodAddrWithToken(
        options.rendezvous_addr, options.rendezvous_port, options.rendezvous_token);
    env[envvar::kHorovodGlooRendezvousPort] = std::to_string(options.rendezvous_port);
  }
  if (options.elastic) env[envvar::kHorovodElastic] = "1";
  if (!options.gloo_iface.empty()) env[envvar::kHorovodGlooIface] = options.gloo_iface;
  if (options.gloo_timeout_seconds > 0) {
    env[envvar::kHorovodGlooTimeoutSeconds] = std::to_string(options.gloo_timeout_seconds);
  }
  return env;
}

}  // namespace efdl::horovod
