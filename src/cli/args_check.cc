#include "cli/args_check.h"

#include <algorithm>
#include <string_view>

#include <fmt/format.h>

namespace efdl::cli {

namespace {

// torchrun's flags (written with dashes; torchrun accepts both spellings) and what `efdl run`
// does instead. `efdl` set: the same meaning, rewritten; otherwise `advice` says what to do.
struct TorchrunFlag {
  std::string_view name;
  std::string_view efdl;
  std::string_view advice;
};

constexpr TorchrunFlag kTorchrunFlags[] = {
    {"--rdzv-id", "--job", ""},
    {"--rdzv-endpoint", "",
     "efdl's rendezvous is etcd: give its endpoints with --etcd HOST:PORT[,HOST:PORT...]"},
    {"--rdzv-backend", "", "efdl's rendezvous is always etcd (--etcd): drop it"},
    {"--rdzv-conf", "", "use efdl run's own --ttl, --last-call and --join-timeout: drop it"},
    {"--node-rank", "", "the nodes agree on their ranks in every round: drop it"},
    {"--master-addr", "",
     "the nodes elect the master in every round: drop it (--advertise-addr sets the address "
     "other nodes reach this one at)"},
    {"--master-port", "", "the nodes elect the master and its port in every round: drop it"},
    {"--standalone", "", "without --etcd, efdl run is a single-node job on a private etcd: drop it"},
    {"--module", "", "give the whole command after --: efdl run [OPTIONS] -- python3 -m MODULE"},
    {"--no-python", "", "give the whole command after --: efdl run [OPTIONS] -- PROGRAM ARGS"},
    {"--monitor-interval", "", "torchrun's flag has no efdl run counterpart: drop it"},
    {"--start-method", "", "efdl run starts every worker as its own process: drop it"},
    {"--redirects", "", "efdl run prefixes each worker's lines with its rank; --log-dir also "
                        "writes them to files: drop it"},
    {"--tee", "", "efdl run prefixes each worker's lines with its rank; --log-dir also writes "
                  "them to files: drop it"},
    {"--role", "", "torchrun's flag has no efdl run counterpart: drop it"},
    {"--local-addr", "", "use --advertise-addr (or --iface) for this node's address"},
};

std::string Dashed(std::string name) {
  // "--nproc_per_node" -> "--nproc-per-node"; the leading dashes stay.
  for (size_t i = 2; i < name.size(); ++i) {
    if (name[i] == '_') name[i] = '-';
  }
  return name;
}

const OptionSpec* FindOption(const CommandSpec& cmd, const std::string& name) {
  for (const OptionSpec& o : cmd.options) {
    if (std::find(o.names.begin(), o.names.end(), name) != o.names.end()) return &o;
  }
  return nullptr;
}

std::vector<std::string> LongNames(const CommandSpec& cmd) {
  std::vector<std::string> out;
  for (const OptionSpec& o : cmd.options) {
    for (const std::string& n : o.names) {
      if (n.starts_with("--")) out.push_back(n);
    }
  }
  return out;
}

Status Unknown(const CommandSpec& cmd, const std::string& what, const std::string& word,
               const std::vector<std::string>& candidates, const std::string& listing) {
  const std::string closest = ClosestWord(word, candidates);
  std::string hint = closest.empty() ? listing : fmt::format("did you mean '{}'?", closest);
  if (!hint.empty()) hint = " " + hint;
  return Status::InvalidArgument(fmt::format("{}: error: unknown {} '{}';{} See `{} --help`",
                                             cmd.path, what, word, hint, cmd.path));
}

}  // namespace

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string ClosestWord(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const std::string& c : candidates) {
    const size_t d = EditDistance(word, c);
    if (d < best_distance) {
      best = c;
      best_distance = d;
    }
  }
  const std::string bare = word.substr(word.find_first_not_of('-') == std::string::npos
                                           ? word.size()
                                           : word.find_first_not_of('-'));
  const size_t allowed = std::max<size_t>(2, bare.size() / 3);
  if (!best.empty() && best_distance <= allowed) return best;
  // A prefix of exactly one candidate ("--nproc" for "--nproc-per-node").
  std::string only;
  for (const std::string& c : candidates) {
    if (bare.size() >= 3 && c.starts_with(word)) {
      if (!only.empty()) return "";
      only = c;
    }
  }
  return only;
}

Result<std::vector<std::string>> CheckArgs(const CommandSpec& root,
                                           const std::vector<std::string>& args) {
  std::vector<std::string> out = args;
  const CommandSpec* cmd = &root;
  for (size_t i = 0; i < out.size(); ++i) {
    const std::string token = out[i];
    if (token == "--") return out;  // the rest belongs to the training command (or CLI11)
    if (token.size() > 1 && token[0] == '-') {
      const size_t eq = token.find('=');
      const std::string name = token.substr(0, eq);
      const std::string value = eq == std::string::npos ? "" : token.substr(eq);
      if (const OptionSpec* o = FindOption(*cmd, name)) {
        if (name == "-h" || name == "--help" || name == "--version") return out;
        if (o->takes_value && eq == std::string::npos) ++i;
        continue;
      }
      const std::string dashed = Dashed(name);
      if (cmd->takes_command) {
        for (const TorchrunFlag& t : kTorchrunFlags) {
          if (dashed != t.name) continue;
          if (t.efdl.empty()) {
            return Status::InvalidArgument(fmt::format("{}: error: {} is torchrun's; {}", cmd->path,
                                                       name, t.advice));
          }
          out[i] = std::string(t.efdl) + value;
          break;
        }
        if (out[i] != token) {
          if (eq == std::string::npos) ++i;  // every rewritten flag takes a value
          continue;
        }
      }
      if (dashed != name) {
        if (const OptionSpec* o = FindOption(*cmd, dashed)) {  // torchrun's --nproc_per_node
          out[i] = dashed + value;
          if (o->takes_value && eq == std::string::npos) ++i;
          continue;
        }
      }
      return Unknown(*cmd, "option", name, LongNames(*cmd), "");
    }
    // A positional word.
    if (!cmd->subcommand_names.empty()) {
      const auto& names = cmd->subcommand_names;
      auto it = std::find(names.begin(), names.end(), token);
      if (it == names.end()) {
        return Unknown(*cmd, "command", token, names,
                       fmt::format("the commands are: {}.", fmt::join(names, ", ")));
      }
      cmd = &cmd->subcommands[static_cast<size_t>(it - names.begin())];
      continue;
    }
    if (cmd->takes_command) {
      // The training command started without `--`: fine for CLI11 unless it has options of
      // its own, which CLI11 would take for efdl's and reject, listing them reversed.
      for (size_t j = i + 1; j < out.size(); ++j) {
        if (out[j].size() > 1 && out[j][0] == '-') {
          return Status::InvalidArgument(fmt::format(
              "{}: error: put `--` between efdl's options and the training command: {} [OPTIONS] -- "
              "{} ... ('{}' was taken for an option of efdl's)",
              cmd->path, cmd->path, token, out[j]));
        }
      }
      return out;
    }
    if (cmd->takes_positionals) continue;
    return Status::InvalidArgument(fmt::format("{}: error: unexpected argument '{}'. See `{} --help`",
                                               cmd->path, token, cmd->path));
  }
  if (!cmd->subcommand_names.empty() && cmd == &root) {
    return Status::InvalidArgument(
        fmt::format("{}: error: no command given; the commands are: {}. See `{} --help`", root.path,
                    fmt::join(root.subcommand_names, ", "), root.path));
  }
  return out;
}

}  // namespace efdl::cli
