// A look at the command line before CLI11 parses it, so that a user's mistake is named as the
// user wrote it: an unknown option or subcommand with the closest real one, torchrun's
// spellings of efdl's options accepted (or the efdl flag to use named), and a training command
// given without `--` in front of its own options. CLI11 alone reports such lines as "The
// following arguments were not expected" followed by the training command, reversed.
#pragma once

#include <string>
#include <vector>

#include "efdl/status.h"

namespace efdl::cli {

struct OptionSpec {
  std::vector<std::string> names;  // "--nnodes", "-h"
  bool takes_value = false;
};

struct CommandSpec {
  std::string path;                  // "efdl", "efdl run", "efdl snapshots list"
  std::vector<OptionSpec> options;
  std::vector<std::string> subcommand_names;
  std::vector<CommandSpec> subcommands;  // parallel to subcommand_names
  bool takes_command = false;        // "-- COMMAND [ARGS...]" (efdl run)
  bool takes_positionals = false;    // other positional arguments
};

// Returns `args` (without the program name) with torchrun spellings rewritten to efdl's, or
// InvalidArgument with one line: what is wrong, what to use, and where the options are listed.
Result<std::vector<std::string>> CheckArgs(const CommandSpec& root,
                                           const std::vector<std::string>& args);

// Levenshtein distance (insertions, deletions, substitutions; each costs 1).
size_t EditDistance(const std::string& a, const std::string& b);

// The candidate closest to `word`, if it is close enough to be a likely typo (an edit distance
// of at most a third of the word, at least 2) or `word` is a prefix of it; "" otherwise.
std::string ClosestWord(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace efdl::cli
