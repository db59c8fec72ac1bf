#include "graphs/ledger_check.h"

#include "common/check.h"

#include <unordered_set>

namespace dwgraph::graphs::detail {
namespace {

// [begin, end) of the bytes `t` spans in the storage at `data`, and whether it covers all
// of them (dense, no gaps).
struct Extent {
  uintptr_t begin = 0, end = 0;
  bool dense = false;
};

Extent extent_of(const TensorSlot& t, const void* data) {
  Extent x;
  int64_t numel = 1, last = 0;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    numel *= t.sizes[d];
    if (t.sizes[d] > 1) last += (t.sizes[d] - 1) * t.strides[d];
  }
  if (numel == 0) return x;
  const auto item = static_cast<int64_t>(c10::elementSize(t.dtype));
  x.begin = reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(t.storage_offset * item);
  x.end = x.begin + static_cast<uintptr_t>((last + 1) * item);
  x.dense = last + 1 == numel;
  return x;
}

bool overwrites_whole(const OpRecord& rec, size_t arg) {
  static const std::unordered_set<std::string> kSelf = {"aten::zero_", "aten::fill_", "aten::copy_"};
  const auto& a = rec.op.schema().arguments()[arg];
  if (a.kwarg_only() && a.alias_info() != nullptr && a.alias_info()->isWrite()) return true;  // out=
  return arg == 0 && kSelf.count(rec.op.schema().operator_name().name) > 0;
}

}  // namespace

std::vector<std::string> describe_records(const std::vector<OpRecord>& records) {
  std::vector<std::string> out;
  for (const auto& r : records) {
    const auto& name = r.op.schema().operator_name();
    std::string s = name.name + (name.overload_name.empty() ? "" : "." + name.overload_name);
    if (r.skip_at_replay) s += " [skipped]";
    if (!r.constants.empty()) s += " [" + std::to_string(r.constants.size()) + " restored constant(s)]";
    out.push_back(std::move(s));
  }
  return out;
}

void check_ledger(const allocator::Ledger& ledger, const std::vector<OpRecord>& records,
                  const char* backend) {
  for (size_t i = 0; i < ledger.size(); ++i) {
    const auto& e = ledger.entry(i);
    if (e.ownership == allocator::Ownership::kGraph || ledger.lock(i).has_value()) continue;
    std::string what = c10::str("a ", e.nbytes, "-byte storage");
    for (size_t r = 0; r < records.size() && what.front() == 'a'; ++r) {
      const auto& rec = records[r];
      for (size_t a = 0; a < rec.args.size(); ++a) {
        for (const auto& t : rec.args[a].tensors) {
          if (!t.defined || t.no_memory || t.entry != i) continue;
          what = c10::str("kernel ", rec.op.schema().operator_name(), " (call ", r + 1, " of ", records.size(),
                          ") argument '", rec.op.schema().arguments()[a].name(), "', a ", t.dtype,
                          " tensor of shape ", c10::IntArrayRef(t.sizes));
          break;
        }
        if (what.front() != 'a') break;
      }
    }
    DWGRAPH_RAISE(ErrorCode::kDanglingCapture, "dwgraph ", backend, " replay: ", what, " (",
                  allocator::to_string(e.ownership), e.role.empty() ? std::string() : ", " + e.role,
                  ") lives in a storage its owner released (or reallocated) after capture; the graph "
                  "would write into memory that may belong to someone else, so nothing was run. Keep the "
                  "tensor alive while the graph can replay, or reset() the graph.");
  }
}

bool record_touches(const std::vector<OpRecord>& records, size_t entry, bool writes_only) {
  auto hits = [&](const ValueSlot& v, bool written) {
    if (writes_only && !written) return false;
    for (const auto& t : v.tensors) {
      if (t.defined && !t.no_memory && t.entry == entry) return true;
    }
    return false;
  };
  for (const auto& rec : records) {
    if (rec.skip_at_replay) continue;
    for (const auto& a : rec.args) {
      if (hits(a, a.written)) return true;
    }
    for (const auto& r : rec.returns) {
      for (size_t k = 0; k < r.tensors.size(); ++k) {
        const auto& t = r.tensors[k];
        if (k < r.fresh.size() && r.fresh[k] && t.defined && !t.no_memory && t.entry == entry) return true;
      }
    }
  }
  return false;
}

std::vector<MemoryAccess> pool_accesses(const allocator::Ledger& ledger, const std::vector<OpRecord>& records) {
  std::vector<MemoryAccess> out;
  auto add = [&](const TensorSlot& t, MemoryAccess::Kind kind) {
    if (!t.defined || t.no_memory) return;
    const auto& e = ledger.entry(t.entry);
    if (e.ownership != allocator::Ownership::kGraph) return;
    const Extent x = extent_of(t, e.data);
    if (x.begin == x.end) return;
    // Memory this capture allocated holds nothing of another graph: reading it before
    // writing it (an in-place random fill of a fresh buffer) expects no other graph's data.
    if (kind != MemoryAccess::Kind::kWrite && e.born_in_capture) {
      if (kind == MemoryAccess::Kind::kRead) return;
      kind = MemoryAccess::Kind::kWrite;
    }
    // A write that leaves gaps keeps the bytes between: count it as read-and-write.
    if (kind == MemoryAccess::Kind::kWrite && !x.dense) kind = MemoryAccess::Kind::kReadWrite;
    out.push_back(MemoryAccess{x.begin, x.end, kind});
  };
  for (const auto& rec : records) {
    if (rec.skip_at_replay) continue;
    for (const auto& [entry, bytes] : rec.constants) {
      const auto& e = ledger.entry(entry);
      const auto begin = reinterpret_cast<uintptr_t>(e.data);
      out.push_back(MemoryAccess{begin, begin + bytes.size(), MemoryAccess::Kind::kWrite});
    }
    for (size_t a = 0; a < rec.args.size(); ++a) {
      const auto& arg = rec.args[a];
      const auto kind = !arg.written ? MemoryAccess::Kind::kRead
                        : overwrites_whole(rec, a) ? MemoryAccess::Kind::kWrite
                                                   : MemoryAccess::Kind::kReadWrite;
      for (const auto& t : arg.tensors) add(t, kind);
    }
    for (const auto& ret : rec.returns) {
      for (size_t k = 0; k < ret.tensors.size(); ++k) {
        if (k < ret.fresh.size() && ret.fresh[k]) add(ret.tensors[k], MemoryAccess::Kind::kWrite);
      }
    }
  }
  return out;
}

}  // namespace dwgraph::graphs::detail
