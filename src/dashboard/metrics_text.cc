#include "dashboard/metrics_text.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

namespace efdl::dashboard {

namespace {

bool NameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool NameChar(char c) { return NameStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

void SkipSpaces(std::string_view s, size_t* i) {
  while (*i < s.size() && (s[*i] == ' ' || s[*i] == '\t')) ++*i;
}

bool ParseValue(std::string_view token, double* out) {
  if (token == "NaN") {
    *out = std::numeric_limits<double>::quiet_NaN();
    return true;
  }
  if (token == "+Inf" || token == "Inf") {
    *out = std::numeric_limits<double>::infinity();
    return true;
  }
  if (token == "-Inf") {
    *out = -std::numeric_limits<double>::infinity();
    return true;
  }
  if (!token.empty() && token[0] == '+') token.remove_prefix(1);
  auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), *out);
  return ec == std::errc() && end == token.data() + token.size();
}

// One sample line; an empty message: parsed.
std::string ParseLine(std::string_view line, MetricSample* out) {
  size_t i = 0;
  if (!NameStart(line[0])) return "a sample must start with a metric name";
  while (i < line.size() && NameChar(line[i])) ++i;
  out->name = std::string(line.substr(0, i));
  SkipSpaces(line, &i);
  if (i < line.size() && line[i] == '{') {
    ++i;
    while (true) {
      SkipSpaces(line, &i);
      if (i < line.size() && line[i] == '}') {
        ++i;
        break;
      }
      size_t start = i;
      while (i < line.size() && NameChar(line[i])) ++i;
      if (i == start) return "a label name is missing";
      std::string label(line.substr(start, i - start));
      SkipSpaces(line, &i);
      if (i >= line.size() || line[i] != '=') return "'=' is missing after label " + label;
      ++i;
      SkipSpaces(line, &i);
      if (i >= line.size() || line[i] != '"') return "the value of label " + label + " is not quoted";
      ++i;
      std::string value;
      bool closed = false;
      while (i < line.size()) {
        char c = line[i++];
        if (c == '"') {
          closed = true;
          break;
        }
        if (c == '\\') {
          if (i >= line.size()) break;
          char e = line[i++];
          value += e == 'n' ? '\n' : e;  // \\ and \" stand for themselves
        } else {
          value += c;
        }
      }
      if (!closed) return "the value of label " + label + " is not closed";
      out->labels[label] = std::move(value);
      SkipSpaces(line, &i);
      if (i < line.size() && line[i] == ',') ++i;
      else if (i >= line.size() || line[i] != '}') return "',' or '}' expected after label " + label;
    }
    SkipSpaces(line, &i);
  }
  size_t start = i;
  while (i < line.size() && line[i] != ' ' && line[i] != '\t') ++i;
  if (!ParseValue(line.substr(start, i - start), &out->value)) {
    return fmt::format("'{}' is not a sample value", line.substr(start, i - start));
  }
  return "";
}

}  // namespace

Result<std::vector<MetricSample>> ParseMetricsText(std::string_view text) {
  std::vector<MetricSample> out;
  size_t line_no = 0;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    size_t first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos || line[first] == '#') continue;
    MetricSample sample;
    std::string why = ParseLine(line.substr(first), &sample);
    if (!why.empty()) {
      return Status::InvalidArgument(fmt::format("metrics line {}: {}", line_no, why));
    }
    out.push_back(std::move(sample));
  }
  return out;
}

NodeMetrics ExtractNodeMetrics(const std::vector<MetricSample>& samples) {
  NodeMetrics out;
  for (const MetricSample& s : samples) {
    if (!std::isfinite(s.value)) continue;
    if (s.name == "efdl_rank_step") {
      auto it = s.labels.find("rank");
      int rank = 0;
      if (it == s.labels.end() || s.value < 0) continue;
      auto [end, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), rank);
      if (ec != std::errc() || end != it->second.data() + it->second.size()) continue;
      out.ranks.push_back({rank, static_cast<int64_t>(s.value)});
    } else if (s.name == "efdl_round") {
      out.round = static_cast<int64_t>(s.value);
    } else if (s.name == "efdl_world_size") {
      out.world_size = static_cast<int>(s.value);
    }
  }
  std::sort(out.ranks.begin(), out.ranks.end(),
            [](const RankStep& a, const RankStep& b) { return a.rank < b.rank; });
  return out;
}

}  // namespace efdl::dashboard
