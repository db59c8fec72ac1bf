#pragma once
// What replay checks of a capture's records (dwgraph::graphs::detail): released storages
// (SPEC C7) and the pool memory each graph reads and writes (Note [Replay order on a
// shared pool], graphs/pool_order.h). Shared by the host and CUDA backends.

#include "allocator/ledger.h"
#include "graphs/pool_order.h"
#include "graphs/recorder.h"

#include <string>
#include <vector>

namespace dwgraph::graphs::detail {

// Names of the records, "[skipped]" marking those replay does not re-run.
std::vector<std::string> describe_records(const std::vector<OpRecord>& records);

// Raises DanglingCaptureError, naming the first recorded call that touches it, when a
// storage the graph does not own has been released (or reallocated) by its owner.
void check_ledger(const allocator::Ledger& ledger, const std::vector<OpRecord>& records,
                  const char* backend);

// True when a replayed record writes (or, without writes_only, reads or writes) ledger
// entry `entry`.
bool record_touches(const std::vector<OpRecord>& records, size_t entry, bool writes_only);

// The graph-pool byte ranges the replayed calls read and write, in call order. Arguments
// a call writes count as read-and-write unless the call is known to overwrite them whole
// (out= arguments, zero_, fill_, copy_ of a dense tensor); restored constants are writes.
std::vector<MemoryAccess> pool_accesses(const allocator::Ledger& ledger, const std::vector<OpRecord>& records);

}  // namespace dwgraph::graphs::detail
