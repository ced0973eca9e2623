// Fragment planning: where to run a job of N processes (one per GPU) when no single host has N
// free GPUs. Pure functions, no I/O; `efdl plan` is a thin front end.
//
// The placement a scheduler should use is chosen by, in this order:
//   1. fewest parts (hosts): every extra part adds cross-host traffic;
//   2. least leftover fragmentation: compare the free-GPU counts that remain on every host
//      after the placement, sorted from largest to smallest, and take the lexicographically
//      largest list. This keeps the largest free blocks intact for the next job (best fit),
//      and fills hosts exactly whenever that is possible at the same part count;
//   3. ties: the set of hosts that comes first in the input order, then more processes on the
//      earlier hosts.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "efdl/status.h"

namespace efdl::plan {

struct HostFree {
  std::string host;
  int free = 0;  // free GPUs (process slots); 0 is allowed and never used
};

struct PlanRequest {
  int procs = 0;                // processes the job needs, >= 1
  std::vector<HostFree> hosts;  // unique host names
  int max_parts = 0;            // 0: no limit
};

struct Part {
  std::string host;
  int procs = 0;
  int free = 0;  // free before the placement
};

struct Placement {
  int procs = 0;
  std::vector<Part> parts;                         // in input order
  std::vector<HostFree> leftover;                  // every host, input order, free afterwards
  // False only when the search space was too large to search fully within its budget (very
  // many parts over many distinct free counts); the placement is then valid but may not be the
  // best by rule 2.
  bool proven_best = true;
};

// Parses "host1:3,host2:6". One clear error for an empty list or entry, a missing ':', an empty
// host name, a count that is not a non-negative integer, and a host listed twice.
Result<std::vector<HostFree>> ParseFreeList(std::string_view text);

// The placement described at the top of this file. InvalidArgument for bad input (procs < 1,
// negative free, duplicate or empty host, max_parts < 0); FailedPrecondition, with a message
// saying how close the hosts come ("need 8 processes in at most 2 parts, but the 2 hosts with
// the most free GPUs give only 7 (b 4 + c 3)"), when no placement exists.
Result<Placement> PlanPlacement(const PlanRequest& request);

}  // namespace efdl::plan
