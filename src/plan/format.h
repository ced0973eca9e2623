// How `efdl plan` shows a placement: a few lines for people, or one JSON object for schedulers.
#pragma once

#include <string>

#include "plan/planner.h"

namespace efdl::plan {

// "placement for 8 processes in 2 parts:" then one line per part and the free GPUs left, or
// the "no placement: ..." line. Ends with a newline.
std::string FormatPlacementText(const Result<Placement>& result);

// {"procs":8,"parts":[{"host":"host1","procs":3,"free":3},...],"leftover":[{"host":"host1","free":0},...],
//  "proven_best":true} or {"procs":8,"parts":null,"reason":"no placement: ..."}; one line.
std::string FormatPlacementJson(int procs, const Result<Placement>& result);

}  // namespace efdl::plan
