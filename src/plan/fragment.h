// Fragmented rounds (`efdl run --world-size N`): which registered nodes take part.
//
// Pure function for the rendezvous: given the nodes in join order (oldest first) with their
// process counts, pick nodes whose counts add up to exactly N, preferring
//   1. fewer nodes,
//   2. larger nodes: the chosen counts, sorted from largest to smallest, lexicographically
//      largest (so 4+4 beats 4+2+2 by rule 1, and 5+3 beats 4+4 by rule 2),
//   3. older members: among nodes with the same count, the earliest joined.
// The others wait as standby.
#pragma once

#include <cstddef>
#include <vector>

#include "efdl/status.h"

namespace efdl::plan {

// Indices (into nproc_in_join_order, ascending) of the chosen nodes. InvalidArgument when
// world_size < 1 or > 1,000,000 or a count is < 1; NotFound, saying what is registered, when
// no subset adds up to world_size.
Result<std::vector<size_t>> ChooseFragmentMembers(const std::vector<int>& nproc_in_join_order,
                                                  int world_size);

}  // namespace efdl::plan
