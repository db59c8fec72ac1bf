#pragma once
// The ledger of a captured graph (namespace dwgraph::allocator): for every storage the
// graph's kernels touch, whether the graph owns it (a block of its private pool) or not
// (the caller's, or a persistent buffer such as a parameter or main_grad), with a weak
// reference to each storage it does not own, so a replay can tell that its owner has
// released it (SPEC C7) instead of writing into memory that may belong to someone else.

#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace dwgraph::allocator {

enum class Ownership { kGraph, kCaller, kPersistent };
const char* to_string(Ownership o);

struct LedgerEntry {
  Ownership ownership = Ownership::kCaller;
  const void* data = nullptr;  // the storage's data pointer at capture
  size_t nbytes = 0;           // the largest extent any captured use of this address had
  size_t owner_nbytes = 0;     // non-owned: the size of the storage the weak reference names
  c10::weak_intrusive_ptr<c10::StorageImpl> weak{c10::intrusive_ptr<c10::StorageImpl>()};  // non-owned
  std::string role;            // e.g. "parameter 'fc1.weight'"; empty when unknown
  // First seen as the fresh output of a captured call: memory this capture allocated, so
  // nothing it reads there before writing it comes from another graph.
  bool born_in_capture = false;
};

class Ledger {
 public:
  // The entry of `storage`, added on first sight. `owned` says it is a block of the
  // graph's pool. Entries are keyed by the data pointer seen at capture.
  // `fresh_output`: the storage is the fresh output of a captured call.
  size_t record(const c10::Storage& storage, bool owned, bool fresh_output = false);
  const LedgerEntry& entry(size_t i) const { return entries_.at(i); }
  size_t size() const { return entries_.size(); }

  // Names a storage the caller knows (a static input, a parameter); `persistent` marks
  // buffers that must outlive the graph (parameters, main_grad).
  void set_role(const c10::Storage& storage, std::string role, bool persistent);
  // Before first sight: the storage is a block of the graph's pool (ownership kGraph),
  // whatever the recorder's test says.
  void mark_owned(const c10::Storage& storage);

  // The live storage of non-owned entry `i`, or nullopt when its owner released it (or
  // it no longer holds the memory the graph captured).
  std::optional<c10::Storage> lock(size_t i) const;

  // The entry of the storage whose data pointer was `data` at capture.
  std::optional<size_t> find(const void* data) const;
  size_t count(Ownership o) const;
  void clear();

 private:
  std::vector<LedgerEntry> entries_;
  std::unordered_map<const void*, size_t> by_data_;
  std::unordered_map<const void*, std::pair<std::string, bool>> roles_;  // before first sight
  std::unordered_map<const void*, bool> owned_;                          // mark_owned, before first sight
};

}  // namespace dwgraph::allocator
