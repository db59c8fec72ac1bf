#include "allocator/ledger.h"

#include <algorithm>

namespace dwgraph::allocator {

const char* to_string(Ownership o) {
  switch (o) {
    case Ownership::kGraph:
      return "graph pool";
    case Ownership::kCaller:
      return "caller";
    case Ownership::kPersistent:
      return "persistent";
  }
  return "?";
}

size_t Ledger::record(const c10::Storage& storage, bool owned, bool fresh_output) {
  const void* data = storage.data();
  auto it = by_data_.find(data);
  if (it != by_data_.end()) {
    // The same address can come back as a new storage (a pool block reused inside the
    // capture): the newest owner is what later kernels touch.
    LedgerEntry& e = entries_[it->second];
    // A reused block may come back larger (coalesced): the entry spans the largest use.
    e.nbytes = std::max(e.nbytes, storage.nbytes());
    if (!owned && e.ownership != Ownership::kGraph) {
      e.weak = storage.getWeakStorageImpl();
      e.owner_nbytes = storage.nbytes();
    }
    return it->second;
  }
  if (!owned && owned_.count(data) != 0) owned = true;
  LedgerEntry e;
  e.data = data;
  e.nbytes = storage.nbytes();
  e.born_in_capture = owned && fresh_output;
  if (owned) {
    e.ownership = Ownership::kGraph;
  } else {
    e.ownership = Ownership::kCaller;
    e.weak = storage.getWeakStorageImpl();
    e.owner_nbytes = storage.nbytes();
    auto r = roles_.find(data);
    if (r != roles_.end()) {
      e.role = r->second.first;
      if (r->second.second) e.ownership = Ownership::kPersistent;
    }
  }
  entries_.push_back(std::move(e));
  by_data_[data] = entries_.size() - 1;
  return entries_.size() - 1;
}

void Ledger::set_role(const c10::Storage& storage, std::string role, bool persistent) {
  const void* data = storage.data();
  auto it = by_data_.find(data);
  if (it != by_data_.end()) {
    LedgerEntry& e = entries_[it->second];
    e.role = role;
    if (persistent && e.ownership == Ownership::kCaller) e.ownership = Ownership::kPersistent;
  }
  roles_[data] = {std::move(role), persistent};
}

void Ledger::mark_owned(const c10::Storage& storage) { owned_[storage.data()] = true; }

std::optional<c10::Storage> Ledger::lock(size_t i) const {
  const LedgerEntry& e = entries_.at(i);
  auto strong = e.weak.lock();
  if (!strong) return std::nullopt;
  c10::Storage s(std::move(strong));
  if (s.data() != e.data || s.nbytes() < e.owner_nbytes) return std::nullopt;
  return s;
}

std::optional<size_t> Ledger::find(const void* data) const {
  auto it = by_data_.find(data);
  if (it == by_data_.end()) return std::nullopt;
  return it->second;
}

size_t Ledger::count(Ownership o) const {
  size_t n = 0;
  for (const auto& e : entries_) n += e.ownership == o ? 1 : 0;
  return n;
}

void Ledger::clear() {
  entries_.clear();
  by_data_.clear();
  roles_.clear();
  owned_.clear();
}

}  // namespace dwgraph::allocator
