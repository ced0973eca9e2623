// Copies into snapshot memory with non-temporal (streaming) stores.
//
// A commit writes every tensor into an arena slot that nobody reads soon (the persister, up to
// a second later, or a restore after a crash). Ordinary stores would first read each line of the
// destination and then keep it in the cache, evicting the training loop's own data (its
// parameters, gradients and inputs): in the digits benchmark that eviction cost the step after
// a commit more than the commit itself. Streaming stores skip both.
#pragma once

#include <cstddef>

namespace efdl::snapshot {

// memcpy(dst, src, n) that bypasses the cache for dst where the CPU allows it (x86-64 SSE2),
// else a plain memcpy. Ordered before the caller's later stores (it ends with a store fence), so
// publishing the slot afterwards cannot make a reader see the data unwritten. Thread-safe on
// disjoint destinations.
void StreamCopy(void* dst, const void* src, size_t n);

}  // namespace efdl::snapshot
