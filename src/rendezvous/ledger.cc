#include "rendezvous/ledger.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <iterator>

#include "rendezvous/protocol.h"

namespace efdl::rdzv {

using nlohmann::json;

namespace {

template <typename T>
bool Get(const json& j, const char* name, T& out) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return true;
  try {
    out = it->get<T>();
    return true;
  } catch (const json::exception&) {
    return false;
  }
}

std::string Iso(double wall) {
  if (wall <= 0) return "-";
  const std::time_t t = static_cast<std::time_t>(wall);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

std::string LedgerPart::Encode() const {
  json j = {{"node", node},       {"r", round},          {"world", world},
            {"nodes", nnodes},    {"prev_world", prev_world}, {"prev_nodes", prev_nnodes},
            {"why", why},         {"graceful", graceful},  {"sign", sign},
            {"detect", detection_s}, {"start", start},   {"restored", restored},
            {"progress", progress}, {"step_samples", step_samples},
            {"no_progress", ended_before_progress},
            {"step", step},       {"prev_step", prev_step}, {"prev_at", prev_at},
            {"step_s", step_s},    {"uncommitted", uncommitted},
            {"min_nodes", min_nodes}, {"joined", joined}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<LedgerPart> LedgerPart::Decode(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  LedgerPart p;
  if (!j.is_object() || !Get(j, "node", p.node) || !Get(j, "r", p.round) ||
      !Get(j, "world", p.world) || !Get(j, "nodes", p.nnodes) ||
      !Get(j, "prev_world", p.prev_world) || !Get(j, "prev_nodes", p.prev_nnodes) ||
      !Get(j, "why", p.why) || !Get(j, "graceful", p.graceful) || !Get(j, "sign", p.sign) ||
      !Get(j, "detect", p.detection_s) || !Get(j, "start", p.start) ||
      !Get(j, "progress", p.progress) || !Get(j, "restored", p.restored) ||
      !Get(j, "step_samples", p.step_samples) ||
      !Get(j, "no_progress", p.ended_before_progress) || !Get(j, "step", p.step) ||
      !Get(j, "prev_step", p.prev_step) || !Get(j, "prev_at", p.prev_at) ||
      !Get(j, "step_s", p.step_s) || !Get(j, "uncommitted", p.uncommitted) ||
      !Get(j, "min_nodes", p.min_nodes) || !Get(j, "joined", p.joined) || p.round <= 0) {
    return Status::Corruption("not a ledger part: " + text.substr(0, 200));
  }
  return p;
}

std::string LedgerEnd::Encode() const {
  return json{{"node", node}, {"r", round}, {"at", at}, {"how", how}}.dump(
      -1, ' ', false, json::error_handler_t::replace);
}

Result<LedgerEnd> LedgerEnd::Decode(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  LedgerEnd e;
  if (!j.is_object() || !Get(j, "node", e.node) || !Get(j, "r", e.round) ||
      !Get(j, "at", e.at) || !Get(j, "how", e.how)) {
    return Status::Corruption("not a ledger end record: " + text.substr(0, 200));
  }
  return e;
}

std::string LedgerPrefix(const std::string& job_id) { return JobKeyPrefix(job_id) + "ledger/"; }

std::string LedgerPartKey(const std::string& job_id, const std::string& node, int64_t round) {
  return fmt::format("{}{}/r{:012d}", LedgerPrefix(job_id), node, round);
}

std::string LedgerEndKey(const std::string& job_id, const std::string& node) {
  return LedgerPrefix(job_id) + node + "/end";
}

namespace {

// What the event that led to `round` was, from the nodes before and after and its reason. A
// node lost without warning is a crash even when the round's reason is a survivor's worker
// failure (its collective lost the peer, and its report reached the coordinator first).
std::string KindOf(const LedgerEvent& e) {
  if (e.why.find("resumed") != std::string::npos) return "resume";
  if (e.detection_s > 0) return "hang";
  if (e.nodes_after < e.nodes_before) return e.graceful ? "leave" : "crash";
  if (e.nodes_after > e.nodes_before) return "join";
  if (e.why.find("failed") != std::string::npos) return "failure";
  return e.graceful ? "change" : "restart";
}

double Median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !(x > 0); }), v.end());
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

LedgerReport Summarize(const std::vector<LedgerPart>& parts, const std::vector<LedgerEnd>& ends,
                       double now) {
  LedgerReport out;
  for (const char* c : {"startup", "training", "lost", "hung", "waiting", "rendezvous",
                        "restore", "suspended"}) {
    out.totals.seconds[c] = 0;
  }
  std::map<int64_t, std::vector<const LedgerPart*>> rounds;
  for (const auto& p : parts) rounds[p.round].push_back(&p);
  if (rounds.empty()) return out;

  // The job's timeline: per round, the boundaries every node agrees on (the earliest sign, the
  // latest start and first progress), clamped so that they never go back in time.
  struct Round {
    int64_t round = 0;
    double sign = 0, hung_until = 0, start = 0, progress = 0;
    double restored = 0;   // every node's ranks restored (0: a node did not say)
    // Fewer than MIN nodes were left by the change: the round waited until this (the time the
    // node that made MIN joined); 0: not below MIN.
    double enough_at = 0;
    bool seen_progress = false;
    bool no_training = false;   // every node's ranks broke before their first progress
    LedgerEvent event;
    double step_s = 0;
  };
  std::vector<Round> timeline;
  for (const auto& [round, ps] : rounds) {
    Round r{};
    r.round = round;
    std::vector<double> step_times, step_samples;
    int64_t prev_step = -1, step = -1, uncommitted = -1;
    double sign = 0, detection = 0;
    bool all_restored = true;
    r.no_training = true;
    for (const LedgerPart* p : ps) {
      r.no_training = r.no_training && p->ended_before_progress;
      r.start = std::max(r.start, p->start);
      if (p->progress > 0) {
        r.progress = std::max(r.progress, p->progress);
        r.seen_progress = true;
        all_restored = all_restored && p->restored > 0;
        r.restored = std::max(r.restored, p->restored);
      }
      step_samples.push_back(p->step_samples);
      if (p->sign > 0) sign = sign > 0 ? std::min(sign, p->sign) : p->sign;
      detection = std::max(detection, p->detection_s);
      prev_step = std::max(prev_step, p->prev_step);
      uncommitted = std::max(uncommitted, p->uncommitted);
      if (p->step >= 0) step = step < 0 ? p->step : std::min(step, p->step);
      step_times.push_back(p->step_s);
      LedgerEvent& e = r.event;
      e.round = round;
      e.why = p->why;
      e.graceful = e.graceful || p->graceful;
      e.world_after = std::max(e.world_after, p->world);
      e.nodes_after = std::max(e.nodes_after, p->nnodes);
      e.world_before = std::max(e.world_before, p->prev_world);
      e.nodes_before = std::max(e.nodes_before, p->prev_nnodes);
      e.nodes.push_back(p->node);
    }
    std::sort(r.event.nodes.begin(), r.event.nodes.end());
    {
      // The nodes that stayed saw the change (a sign); the others joined for this round.
      int stayed = 0, min_nodes = 1;
      std::vector<double> joined;
      for (const LedgerPart* p : ps) {
        min_nodes = std::max(min_nodes, p->min_nodes);
        if (p->sign > 0) {
          ++stayed;
        } else if (p->joined > 0) {
          joined.push_back(p->joined);
        }
      }
      std::sort(joined.begin(), joined.end());
      const int missing = min_nodes - stayed;
      if (stayed > 0 && missing > 0 && static_cast<size_t>(missing) <= joined.size()) {
        r.enough_at = joined[missing - 1];
      }
    }
    if (!all_restored || !r.seen_progress) r.restored = 0;
    r.step_s = Median(step_times);
    r.sign = sign;
    r.hung_until = sign > 0 ? sign + detection : 0;
    r.event.detection_s = detection;
    r.event.at = sign > 0 ? sign : r.start;
    // A report's step is the step just completed: the first one of this round says it resumed
    // after step - 1.
    r.event.steps_lost =
        uncommitted >= 0                ? uncommitted
        : prev_step >= 0 && step >= 0 ? std::max<int64_t>(0, prev_step - (step - 1))
                                        : 0;
    // (the parts of the nodes that stayed carry the previous round's samples per step)
    r.event.step_samples = Median(step_samples);
    if (const double per_rank = r.event.step_samples; per_rank > 0 && r.event.world_before > 0) {
      r.event.samples_lost = std::llround(static_cast<double>(r.event.steps_lost) * per_rank *
                                          r.event.world_before);
    }
    timeline.push_back(r);
  }
  // Ends: the earliest end of a node of the last round closes the job (complete, suspended).
  const int64_t last_round = timeline.back().round;
  double job_end = 0;
  std::map<int64_t, double> end_of_round;   // earliest end record per round
  for (const auto& e : ends) {
    auto [it, fresh] = end_of_round.emplace(e.round, e.at);
    if (!fresh) it->second = std::min(it->second, e.at);
  }
  const auto last_end = end_of_round.find(last_round);
  out.complete = last_end != end_of_round.end();
  job_end = out.complete ? last_end->second : now;

  double t = timeline.front().start;
  out.begin = t;
  auto add = [&](const char* category, double until) {
    if (until > t) {
      out.totals.seconds[category] += until - t;
      t = until;
    }
  };
  for (size_t i = 0; i < timeline.size(); ++i) {
    Round& r = timeline[i];
    const bool first = i == 0;
    if (!first) {
      // The gap between the previous round's training and this round's start.
      LedgerEvent& e = r.event;
      const std::vector<std::string>& before = timeline[i - 1].event.nodes;   // (both sorted)
      std::set_difference(before.begin(), before.end(), e.nodes.begin(), e.nodes.end(),
                          std::back_inserter(e.left));
      std::set_difference(e.nodes.begin(), e.nodes.end(), before.begin(), before.end(),
                          std::back_inserter(e.joined));
      if (e.world_before == 0) {   // new agents (a resume): the previous round says
        e.world_before = timeline[i - 1].event.world_after;
        e.nodes_before = timeline[i - 1].event.nodes_after;
      }
      const double gap_from = t;
      const bool resumed = e.why.find("resumed") != std::string::npos;
      if (r.sign > 0) add("hung", std::min(r.hung_until, r.start));
      const double hung_until = t;
      if (!resumed && r.enough_at > 0) add("waiting", std::min(r.enough_at, r.start));
      const double waited_until = t;
      add(resumed ? "suspended" : "rendezvous", r.start);
      e.detection_s = hung_until - gap_from;
      e.waiting_s = waited_until - hung_until;
      e.rendezvous_s = t - waited_until;
      e.kind = KindOf(e);
    }
    // Start-up or restore: the workers started until every rank progressed.
    const double restore_from = t;
    // The training of this round ends at the next round's first sign (or its start, for a
    // change no node saw coming: a suspended job's new agents), or the job's end.
    double train_end = job_end;
    if (i + 1 < timeline.size()) {
      const Round& next = timeline[i + 1];
      train_end = next.sign > 0 ? next.sign : next.start;
      auto e = end_of_round.find(r.round);
      if (next.sign <= 0 && e != end_of_round.end()) train_end = std::min(train_end, e->second);
    }
    // A round that broke before any progress trained nothing: all of it was restore.
    const double progress_at = r.seen_progress ? r.progress
                               : r.no_training ? std::max(train_end, t)
                                               : r.start;
    add(first ? "startup" : "restore", std::min(progress_at, std::max(train_end, t)));
    if (!first) {
      // The State's restore, then the first step (when every node said where one ends).
      const double restored_at =
          r.restored > 0 ? std::clamp(r.restored, restore_from, t) : t;
      r.event.restore_s = restored_at - restore_from;
      r.event.first_step_s = t - restored_at;
      r.event.pause_s = r.event.detection_s + r.event.waiting_s + r.event.rendezvous_s +
                        r.event.restore_s + r.event.first_step_s;
    }
    // Training, less what the next round trained again.
    const double train_from = t;
    add("training", train_end);
    if (i + 1 < timeline.size()) {
      const Round& next = timeline[i + 1];
      // (the next round's parts carry this round's step time: they saw it end)
      const double step_s = next.step_s > 0 ? next.step_s : r.step_s;
      const double lost = std::min(t - train_from, next.event.steps_lost * step_s);
      out.totals.seconds["training"] -= lost;
      out.totals.seconds["lost"] += lost;
    }
  }
  out.end = std::max(t, job_end);
  if (out.end > t) add("training", out.end);   // (a job end before every boundary: none)
  out.totals.wall_s = out.end - out.begin;
  for (size_t i = 1; i < timeline.size(); ++i) out.events.push_back(timeline[i].event);
  return out;
}

std::string LedgerReport::ToJson() const {
  json events_json = json::array();
  for (const auto& e : events) {
    events_json.push_back({{"round", e.round},
                           {"kind", e.kind},
                           {"why", e.why},
                           {"graceful", e.graceful},
                           {"at", Iso(e.at)},
                           {"at_s", e.at},
                           {"world_before", e.world_before},
                           {"world_after", e.world_after},
                           {"nodes_before", e.nodes_before},
                           {"nodes_after", e.nodes_after},
                           {"nodes", e.nodes},
                           {"left", e.left},
                           {"joined", e.joined},
                           {"detection_s", e.detection_s},
                           {"waiting_s", e.waiting_s},
                           {"rendezvous_s", e.rendezvous_s},
                           {"restore_s", e.restore_s},
                           {"first_step_s", e.first_step_s},
                           {"pause_s", e.pause_s},
                           {"steps_lost", e.steps_lost},
                           {"samples_lost", e.samples_lost >= 0 ? json(e.samples_lost)
                                                                : json(nullptr)},
                           {"step_samples", e.step_samples}});
  }
  json j = {{"begin", Iso(begin)},
            {"begin_s", begin},
            {"end_s", end},
            {"complete", complete},
            {"wall_s", totals.wall_s},
            {"goodput", totals.goodput()},
            {"seconds", totals.seconds},
            {"events", events_json}};
  return j.dump(1, ' ', false, json::error_handler_t::replace);
}

std::string LedgerReport::ToText(size_t last_events) const {
  if (totals.wall_s <= 0) return "goodput: no round has trained yet\n";
  std::string out = fmt::format(
      "goodput {:.1f}% of {:.0f} s{} since {}: training {:.1f} s, lost (trained again) {:.1f} "
      "s, start-up {:.1f} s, restore {:.1f} s, rendezvous {:.1f} s, waiting below MIN {:.1f} s, "
      "hung {:.1f} s, suspended {:.1f} s\n",
      100 * totals.goodput(), totals.wall_s, complete ? "" : " (running)", Iso(begin),
      totals.seconds.at("training"), totals.seconds.at("lost"), totals.seconds.at("startup"),
      totals.seconds.at("restore"), totals.seconds.at("rendezvous"),
      totals.seconds.at("waiting"), totals.seconds.at("hung"), totals.seconds.at("suspended"));
  const size_t from = events.size() > last_events ? events.size() - last_events : 0;
  for (size_t i = from; i < events.size(); ++i) {
    const LedgerEvent& e = events[i];
    out += fmt::format(
        "  {} round {:<4} {:<8} world {}->{}: pause {:.2f} s (detection {:.2f},{} rendezvous "
        "{:.2f}, restore {:.2f}, first step {:.2f}), {} step(s){} trained again{}{}; {}\n",
        Iso(e.at), e.round, e.kind, e.world_before, e.world_after, e.pause_s, e.detection_s,
        e.waiting_s > 0 ? fmt::format(" waiting below MIN {:.2f},", e.waiting_s) : "",
        e.rendezvous_s, e.restore_s, e.first_step_s, e.steps_lost,
        e.samples_lost >= 0 ? fmt::format(" ({} samples)", e.samples_lost) : "",
        e.left.empty() ? "" : fmt::format("; left: {}", fmt::join(e.left, ", ")),
        e.joined.empty() ? "" : fmt::format("; joined: {}", fmt::join(e.joined, ", ")), e.why);
  }
  return out;
}

Result<LedgerRecords> ReadLedgerRecords(etcd::Client& client, const std::string& job_id) {
  auto r = client.Range(LedgerPrefix(job_id), {.prefix = true});
  if (!r.ok()) return r.status().WithContext("cannot read the job's ledger");
  LedgerRecords out;
  for (const auto& kv : r->kvs) {
    if (kv.key.ends_with("/end")) {
      if (auto e = LedgerEnd::Decode(kv.value); e.ok()) out.ends.push_back(*e);
    } else if (auto p = LedgerPart::Decode(kv.value); p.ok()) {
      out.parts.push_back(*p);
    }
  }
  return out;
}

Result<std::pair<int64_t, int64_t>> LedgerFingerprint(etcd::Client& client,
                                                      const std::string& job_id) {
  etcd::RangeOptions o{.prefix = true, .limit = 1, .keys_only = true};
  o.sort_order = etcd::RangeOptions::SortOrder::kDescend;
  o.sort_target = etcd::RangeOptions::SortTarget::kModRevision;
  auto r = client.Range(LedgerPrefix(job_id), o);
  if (!r.ok()) return r.status().WithContext("cannot read the job's ledger");
  int64_t newest = 0;
  for (const auto& kv : r->kvs) newest = std::max(newest, kv.mod_revision);
  return std::make_pair(r->count, newest);
}

Result<LedgerReport> ReadLedger(etcd::Client& client, const std::string& job_id, double now) {
  auto records = ReadLedgerRecords(client, job_id);
  if (!records.ok()) return records.status();
  return Summarize(records->parts, records->ends, now);
}

}  // namespace efdl::rdzv
