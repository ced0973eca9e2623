#include "rendezvous/protocol.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <string_view>
#include <unordered_set>

#include "plan/fragment.h"

namespace efdl::rdzv {

using nlohmann::json;

JobKeys::JobKeys(const std::string& job_id)
    : prefix(JobKeyPrefix(job_id)),
      nodes(prefix + "nodes/"),
      assign(prefix + "assign/"),
      ack(prefix + "ack/"),
      round(prefix + "round"),
      program(prefix + "program"),
      status(prefix + "status"),
      complete(prefix + "complete"),
      suspended(prefix + "suspended/"),
      gaveup(prefix + "gaveup/"),
      excluded(prefix + "excluded/"),
      compute(prefix + "compute/"),
      stragglers(prefix + "stragglers") {}

namespace {
constexpr const char* kPhaseNames[] = {"gathering", "proposed", "active", "complete", "suspended"};
constexpr const char* kAckNames[] = {"ack", "done", "failed", "leaving"};

// Records come from etcd, where anything with access to the job's prefix may have written
// anything: errors quote at most this much of the value, so a huge value makes no huge log line.
constexpr size_t kMaxQuoted = 200;

std::string Quoted(const std::string& text) {
  if (text.size() <= kMaxQuoted) return text;
  return fmt::format("{}... ({} bytes)", text.substr(0, kMaxQuoted), text.size());
}

template <class T>
Result<T> ParseWith(const std::string& what, const std::string& text, auto&& fill) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return Status::Corruption(
        fmt::format("{} record is not a JSON object: '{}'", what, Quoted(text)));
  }
  T out;
  if (!fill(j, out)) {
    return Status::Corruption(fmt::format("{} record has bad fields: '{}'", what, Quoted(text)));
  }
  return out;
}

// True when the JSON integer `v` fits in V: an out-of-range value is an error, not a silent
// wrap (a port of 70000 is not port 4464).
template <class V>
bool FitsIn(const json& v) {
  if (v.is_number_unsigned()) {
    return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<V>::max());
  }
  int64_t x = v.get<int64_t>();
  if constexpr (std::is_signed_v<V>) {
    return x >= static_cast<int64_t>(std::numeric_limits<V>::min()) &&
           x <= static_cast<int64_t>(std::numeric_limits<V>::max());
  } else {
    return x >= 0 && static_cast<uint64_t>(x) <= std::numeric_limits<V>::max();
  }
}

// Reads an optional field with the expected JSON type; false on a type mismatch.
template <class V>
bool Field(const json& j, const char* name, V& out) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return true;
  if constexpr (std::is_same_v<V, bool>) {
    if (!it->is_boolean()) return false;
  } else if constexpr (std::is_integral_v<V>) {
    if (!it->is_number_integer() || !FitsIn<V>(*it)) return false;
  } else if constexpr (std::is_floating_point_v<V>) {
    if (!it->is_number() || !std::isfinite(it->get<double>())) return false;
  } else if constexpr (std::is_same_v<V, std::string>) {
    if (!it->is_string()) return false;
  } else {
    static_assert(std::is_same_v<V, std::vector<std::string>>);
    if (!it->is_array()) return false;
    for (const auto& e : *it) {
      if (!e.is_string()) return false;
    }
  }
  out = it->template get<V>();
  return true;
}
}  // namespace

const char* PhaseName(Phase phase) { return kPhaseNames[static_cast<int>(phase)]; }
const char* AckStateName(AckState state) { return kAckNames[static_cast<int>(state)]; }

std::string RoundRecord::Encode() const {
  json j = {{"r", round}, {"ph", PhaseName(phase)}, {"c", coordinator}};
  if (!deputies.empty()) j["d"] = deputies;
  if (graceful) j["g"] = true;
  if (phase == Phase::kActive) {
    j["w"] = world_size;
    j["n"] = nnodes;
    j["ma"] = master_addr;
    j["mp"] = master_port;
    if (horovod_port != 0) j["hp"] = horovod_port;
    if (agent_store) j["as"] = true;
  }
  if (!message.empty()) j["msg"] = message;
  return j.dump();
}

Result<RoundRecord> RoundRecord::Decode(const std::string& text) {
  return ParseWith<RoundRecord>("round", text, [](const json& j, RoundRecord& r) {
    std::string ph;
    bool ok = Field(j, "r", r.round) && Field(j, "ph", ph) && Field(j, "c", r.coordinator) &&
              Field(j, "d", r.deputies) && Field(j, "g", r.graceful) &&
              Field(j, "w", r.world_size) && Field(j, "n", r.nnodes) &&
              Field(j, "ma", r.master_addr) && Field(j, "mp", r.master_port) &&
              Field(j, "hp", r.horovod_port) && Field(j, "as", r.agent_store) &&
              Field(j, "msg", r.message);
    if (!ok) return false;
    for (int i = 0; i < static_cast<int>(std::size(kPhaseNames)); ++i) {
      if (ph == kPhaseNames[i]) {
        r.phase = static_cast<Phase>(i);
        return true;
      }
    }
    return false;
  });
}

std::string SuspendReport::Encode() const {
  json j = {{"step", step ? json(*step) : json(nullptr)}};
  if (!time.empty()) j["t"] = time;
  if (seq) j["seq"] = *seq;
  if (epoch) j["epoch"] = *epoch;
  return j.dump();
}

Result<SuspendReport> SuspendReport::Decode(const std::string& text) {
  return ParseWith<SuspendReport>("suspend report", text, [](const json& j, SuspendReport& s) {
    int64_t value = -1;
    uint64_t seq_value = 0;
    int64_t epoch_value = 0;
    if (!(Field(j, "step", value) && Field(j, "t", s.time) && Field(j, "seq", seq_value) &&
          Field(j, "epoch", epoch_value))) {
      return false;
    }
    if (j.contains("step") && !j["step"].is_null()) {
      if (value < 0) return false;
      s.step = value;
    }
    if (j.contains("seq") && !j["seq"].is_null()) s.seq = seq_value;
    if (j.contains("epoch") && !j["epoch"].is_null()) s.epoch = epoch_value;
    return true;
  });
}

std::string GaveUpRecord::Encode() const {
  json j = {{"reason", reason}};
  if (!time.empty()) j["t"] = time;
  if (!stderr_tail.empty()) j["stderr"] = stderr_tail;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);  // a worker's bytes: not UTF-8
}

Result<GaveUpRecord> GaveUpRecord::Decode(const std::string& text) {
  return ParseWith<GaveUpRecord>("gave-up record", text, [](const json& j, GaveUpRecord& g) {
    if (!j.contains("reason") || !Field(j, "reason", g.reason) || !Field(j, "t", g.time)) {
      return false;
    }
    if (!j.contains("stderr")) return true;
    if (!j["stderr"].is_array()) return false;
    for (const auto& line : j["stderr"]) {
      if (!line.is_string()) return false;
      g.stderr_tail.push_back(line.get<std::string>());
    }
    return true;
  });
}

std::string ExclusionRecord::Encode() const {
  json j = {{"reason", reason}, {"t", time}, {"until", until}, {"failures", failures},
            {"n", exclusion}};
  if (!stderr_tail.empty()) j["stderr"] = stderr_tail;
  if (!cause.empty()) j["cause"] = cause;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);  // a worker's bytes: not UTF-8
}

Result<ExclusionRecord> ExclusionRecord::Decode(const std::string& text) {
  return ParseWith<ExclusionRecord>("exclusion record", text, [](const json& j,
                                                                 ExclusionRecord& e) {
    if (!j.contains("reason") || !Field(j, "reason", e.reason) || !Field(j, "t", e.time) ||
        !Field(j, "until", e.until) || !Field(j, "failures", e.failures) ||
        !Field(j, "n", e.exclusion) || !Field(j, "cause", e.cause)) {
      return false;
    }
    if (!j.contains("stderr")) return true;
    if (!j["stderr"].is_array()) return false;
    for (const auto& line : j["stderr"]) {
      if (!line.is_string()) return false;
      e.stderr_tail.push_back(line.get<std::string>());
    }
    return true;
  });
}

std::string ComputeRecord::Encode() const {
  json ranks = json::object();
  for (const auto& [rank, s] : compute_s) ranks[std::to_string(rank)] = s;
  return json{{"round", round}, {"seq", seq}, {"ranks", ranks}}.dump();
}

Result<ComputeRecord> ComputeRecord::Decode(const std::string& text) {
  return ParseWith<ComputeRecord>("compute", text, [](const json& j, ComputeRecord& c) {
    if (!Field(j, "round", c.round) || !Field(j, "seq", c.seq)) return false;
    auto it = j.find("ranks");
    if (it == j.end()) return true;
    if (!it->is_object()) return false;
    for (const auto& [key, v] : it->items()) {
      if (!v.is_number() || !std::isfinite(v.get<double>())) return false;
      int rank = 0;
      const char* end = key.data() + key.size();
      auto [ptr, ec] = std::from_chars(key.data(), end, rank);
      if (ec != std::errc() || ptr != end || rank < 0) return false;
      c.compute_s[rank] = v.get<double>();
    }
    return true;
  });
}

std::string StragglerRecord::Encode() const {
  json arr = json::array();
  for (const auto& n : nodes) {
    arr.push_back({{"id", n.id}, {"ranks", n.ranks}, {"compute_s", n.compute_s},
                   {"median_s", n.median_s}, {"windows", n.windows}, {"since", n.since}});
  }
  return json{{"round", round}, {"judge", judge}, {"t", time}, {"factor", factor},
              {"window_s", window_s}, {"nodes", arr}}.dump();
}

Result<StragglerRecord> StragglerRecord::Decode(const std::string& text) {
  return ParseWith<StragglerRecord>("stragglers", text, [](const json& j, StragglerRecord& r) {
    if (!Field(j, "round", r.round) || !Field(j, "judge", r.judge) || !Field(j, "t", r.time) ||
        !Field(j, "factor", r.factor) || !Field(j, "window_s", r.window_s)) {
      return false;
    }
    auto it = j.find("nodes");
    if (it == j.end()) return true;
    if (!it->is_array()) return false;
    for (const auto& e : *it) {
      if (!e.is_object()) return false;
      StragglerRecord::Node n;
      if (!Field(e, "id", n.id) || !Field(e, "compute_s", n.compute_s) ||
          !Field(e, "median_s", n.median_s) || !Field(e, "windows", n.windows) ||
          !Field(e, "since", n.since)) {
        return false;
      }
      if (auto ranks = e.find("ranks"); ranks != e.end()) {
        if (!ranks->is_array()) return false;
        for (const auto& x : *ranks) {
          if (!x.is_number_integer()) return false;
          n.ranks.push_back(x.get<int>());
        }
      }
      r.nodes.push_back(std::move(n));
    }
    return true;
  });
}

std::string NodeRecord::Encode() const {
  json j = {{"addr", addr}, {"nproc", nproc}};
  if (!program.empty()) j["prog"] = program;
  if (!metrics.empty()) j["metrics"] = metrics;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<NodeRecord> NodeRecord::Decode(const std::string& text) {
  return ParseWith<NodeRecord>("node", text, [](const json& j, NodeRecord& n) {
    return Field(j, "addr", n.addr) && Field(j, "nproc", n.nproc) && n.nproc > 0 &&
           Field(j, "prog", n.program) && Field(j, "metrics", n.metrics);
  });
}

namespace {
// Horovod's layout in an assign record (MemberAssignments). Process counts are bounded like
// fragmented world sizes, so a damaged record cannot make an agent allocate without limit.
constexpr int kMaxHorovodCount = 1'000'000;

bool HorovodIntList(const json& j, const char* name, std::vector<int>& out) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_array() || it->size() > static_cast<size_t>(kMaxHorovodCount)) return false;
  for (const auto& v : *it) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxHorovodCount) {
      return false;
    }
    out.push_back(v.get<int>());
  }
  return true;
}

bool HorovodHosts(const json& j, std::vector<std::pair<std::string, int>>& out) {
  auto it = j.find("hosts");
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_array()) return false;
  for (const auto& h : *it) {
    if (!h.is_array() || h.size() != 2 || !h[0].is_string() || !h[1].is_number_integer() ||
        h[1].get<int64_t>() < 1 || h[1].get<int64_t>() > kMaxHorovodCount) {
      return false;
    }
    out.emplace_back(h[0].get<std::string>(), h[1].get<int>());
  }
  return true;
}

bool HostAddrs(const json& j, std::vector<std::string>& out) {
  auto it = j.find("ha");
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_array() || it->size() > static_cast<size_t>(kMaxHorovodCount)) return false;
  for (const auto& a : *it) {
    if (!a.is_string() || a.get_ref<const std::string&>().empty() ||
        a.get_ref<const std::string&>().size() > 255) {
      return false;
    }
    out.push_back(a.get<std::string>());
  }
  return true;
}

// A cross rank must lie below its cross size, one pair per local rank.
bool HorovodLayoutValid(const AssignRecord& a) {
  if (a.cross_rank.size() != a.cross_size.size()) return false;
  for (size_t i = 0; i < a.cross_rank.size(); ++i) {
    if (a.cross_rank[i] >= a.cross_size[i]) return false;
  }
  return true;
}
}  // namespace

std::string AssignRecord::Encode() const {
  json j = {{"r", round}};
  if (standby) {
    j["sb"] = true;
  } else {
    j["rank"] = node_rank;
    j["off"] = rank_offset;
    if (!cross_rank.empty()) {
      j["cr"] = cross_rank;
      j["cs"] = cross_size;
    }
    if (!hosts.empty()) {
      json list = json::array();
      for (const auto& [id, nproc] : hosts) list.push_back(json::array({id, nproc}));
      j["hosts"] = std::move(list);
      if (!host_addrs.empty()) j["ha"] = host_addrs;
    }
  }
  if (early_exit) j["ee"] = true;
  if (peer_copy.port != 0) {
    j["pn"] = peer_copy.node;
    j["pa"] = peer_copy.addr;
    j["pp"] = peer_copy.port;
  }
  return j.dump();
}

Result<AssignRecord> AssignRecord::Decode(const std::string& text) {
  return ParseWith<AssignRecord>("assign", text, [](const json& j, AssignRecord& a) {
    return Field(j, "r", a.round) && Field(j, "rank", a.node_rank) &&
           Field(j, "off", a.rank_offset) && Field(j, "sb", a.standby) &&
           HorovodIntList(j, "cr", a.cross_rank) && HorovodIntList(j, "cs", a.cross_size) &&
           HorovodLayoutValid(a) && HorovodHosts(j, a.hosts) && HostAddrs(j, a.host_addrs) &&
           Field(j, "ee", a.early_exit) && Field(j, "pn", a.peer_copy.node) &&
           Field(j, "pa", a.peer_copy.addr) && Field(j, "pp", a.peer_copy.port) &&
           a.peer_copy.addr.size() <= 255 && a.peer_copy.node.size() <= 255;
  });
}

std::string AckRecord::Encode() const {
  json j = {{"r", round}, {"st", AckStateName(state)}};
  if (port != 0) j["port"] = port;
  if (horovod_port != 0) j["hp"] = horovod_port;
  if (peer_copy_port != 0) j["pc"] = peer_copy_port;
  if (agent_store) j["as"] = true;
  if (restarts != 0) j["rs"] = restarts;
  if (!no_prestart.empty()) j["np"] = no_prestart;
  if (!prev_outcome.empty()) {
    j["pr"] = prev_round;
    j["po"] = prev_outcome;
    if (!prev_detail.empty()) j["pd"] = prev_detail;
  }
  return j.dump();
}

Result<AckRecord> AckRecord::Decode(const std::string& text) {
  return ParseWith<AckRecord>("ack", text, [](const json& j, AckRecord& a) {
    std::string st;
    if (!(Field(j, "r", a.round) && Field(j, "st", st) && Field(j, "port", a.port) &&
          Field(j, "hp", a.horovod_port) && Field(j, "pc", a.peer_copy_port) &&
          Field(j, "as", a.agent_store) && Field(j, "rs", a.restarts) &&
          Field(j, "np", a.no_prestart) &&
          Field(j, "pr", a.prev_round) && Field(j, "po", a.prev_outcome) &&
          Field(j, "pd", a.prev_detail))) {
      return false;
    }
    if (!a.prev_outcome.empty() && a.prev_outcome != kOutcomeDone &&
        a.prev_outcome != kOutcomeFailed && a.prev_outcome != kOutcomeLost) {
      return false;
    }
    for (int i = 0; i < 4; ++i) {
      if (st == kAckNames[i]) {
        a.state = static_cast<AckState>(i);
        return true;
      }
    }
    return false;
  });
}

namespace {

// Appends `c` as the plan's next member: its node rank is the count of members before it, its
// ranks follow theirs (plan.world_size sums their nproc); the first member offers the master
// address.
void AddMember(Plan& plan, const Candidate& c) {
  if (plan.members.empty()) {
    plan.master_addr = c.addr;
    plan.master_port = c.port;
    plan.agent_store = c.agent_store;
  }
  plan.members.push_back(
      {c.id, static_cast<int>(plan.members.size()), plan.world_size, c.nproc, c.addr});
  plan.world_size += c.nproc;
}

// Fragmented mode (limits.world_size > 0): `order` is already previous members first, then
// joiners by age, so ChooseFragmentMembers' "older first" rule keeps running members whenever
// an exact fit with as few nodes exists, and the chosen keep that order (stable ranks).
Plan PlanFragmentedRound(const std::vector<const Candidate*>& order, const PlanLimits& limits) {
  Plan plan;
  std::vector<int> nproc;
  nproc.reserve(order.size());
  for (const Candidate* c : order) nproc.push_back(c->nproc);
  auto chosen = plan::ChooseFragmentMembers(nproc, limits.world_size);
  const int count = chosen.ok() ? static_cast<int>(chosen->size()) : 0;
  if (!chosen.ok() || count < limits.min_nodes || count > limits.max_nodes) {
    for (const Candidate* c : order) plan.standbys.push_back(c->id);
    return plan;
  }
  std::vector<bool> member(order.size(), false);
  for (size_t i : *chosen) member[i] = true;
  for (size_t i = 0; i < order.size(); ++i) {
    if (member[i]) {
      AddMember(plan, *order[i]);
    } else {
      plan.standbys.push_back(order[i]->id);
    }
  }
  plan.formed = plan.world_size == limits.world_size;
  return plan;
}

}  // namespace

Result<StatusRecord> StatusRecord::Decode(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    return Status::Corruption(
        fmt::format("status record is not a JSON object: '{}'", Quoted(text)));
  }
  StatusRecord out;
  auto array = [&](const char* name) -> const json* {
    auto it = j.find(name);
    return it != j.end() && it->is_array() ? &*it : nullptr;
  };
  if (const json* members = array("members")) {
    for (const auto& m : *members) {
      Member member;
      if (!m.is_object() || !Field(m, "id", member.id) || !Field(m, "addr", member.addr) ||
          !Field(m, "nproc", member.nproc) || !Field(m, "rank", member.rank)) {
        continue;
      }
      out.members.push_back(std::move(member));
    }
  }
  if (const json* standbys = array("standbys")) {
    for (const auto& s : *standbys) {
      if (s.is_string()) out.standbys.push_back(s.get<std::string>());
    }
  }
  if (const json* events = array("events")) {
    for (const auto& e : *events) {
      Event event;
      if (e.is_object() && Field(e, "time", event.time) && Field(e, "message", event.message)) {
        out.events.push_back(std::move(event));
      }
    }
  }
  return out;
}

Plan PlanRound(const std::vector<Candidate>& candidates,
               const std::map<std::string, int>& previous_rank, const PlanLimits& limits) {
  std::vector<const Candidate*> order;
  order.reserve(candidates.size());
  for (const auto& c : candidates) order.push_back(&c);
  auto key = [&](const Candidate* c) {
    auto it = previous_rank.find(c->id);
    return it != previous_rank.end() ? std::pair<int, int64_t>(0, it->second)
                                     : std::pair<int, int64_t>(1, c->create_revision);
  };
  std::sort(order.begin(), order.end(),
            [&](const Candidate* a, const Candidate* b) { return key(a) < key(b); });
  if (limits.world_size > 0) return PlanFragmentedRound(order, limits);

  Plan plan;
  for (const Candidate* c : order) {
    if (static_cast<int>(plan.members.size()) < limits.max_nodes) {
      AddMember(plan, *c);
    } else {
      plan.standbys.push_back(c->id);
    }
  }
  plan.formed = static_cast<int>(plan.members.size()) >= limits.min_nodes &&
                !plan.members.empty();
  return plan;
}

std::vector<AssignRecord> MemberAssignments(int64_t round, const Plan& plan) {
  std::vector<AssignRecord> out;
  out.reserve(plan.members.size());
  bool uniform = true;
  int max_nproc = 0;
  for (const auto& m : plan.members) {
    uniform = uniform && m.nproc == plan.members.front().nproc;
    max_nproc = std::max(max_nproc, m.nproc);
  }
  // cross_size[l]: members with a local rank l; next_cross[l]: the next cross rank to hand out.
  std::vector<int> cross_size(uniform ? 0 : static_cast<size_t>(max_nproc), 0);
  std::vector<int> next_cross(cross_size.size(), 0);
  if (!uniform) {
    for (const auto& m : plan.members) {
      for (int l = 0; l < m.nproc; ++l) ++cross_size[static_cast<size_t>(l)];
    }
  }
  for (const auto& m : plan.members) {
    AssignRecord a;
    a.round = round;
    a.node_rank = m.node_rank;
    a.rank_offset = m.rank_offset;
    if (!uniform) {
      for (int l = 0; l < m.nproc; ++l) {
        auto li = static_cast<size_t>(l);
        a.cross_rank.push_back(next_cross[li]++);
        a.cross_size.push_back(cross_size[li]);
      }
    }
    out.push_back(std::move(a));
  }
  if (!out.empty()) {
    out.front().hosts.reserve(plan.members.size());
    std::unordered_set<std::string_view> seen;
    for (const auto& m : plan.members) {
      out.front().hosts.emplace_back(m.id, m.nproc);
      if (!m.addr.empty() && seen.insert(m.addr).second) out.front().host_addrs.push_back(m.addr);
    }
  }
  return out;
}

std::vector<PeerCopyTarget> PeerCopyRing(
    const Plan& plan, const std::function<uint16_t(const std::string&)>& port_of) {
  std::vector<PeerCopyTarget> out(plan.members.size());
  if (plan.members.size() < 2) return out;
  for (size_t i = 0; i < plan.members.size(); ++i) {
    const PlannedNode& next = plan.members[(i + 1) % plan.members.size()];
    const uint16_t port = port_of(next.id);
    if (port != 0 && !next.addr.empty()) out[i] = PeerCopyTarget{next.id, next.addr, port};
  }
  return out;
}

}  // namespace efdl::rdzv
