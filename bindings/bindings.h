#pragma once
// One init_* function per bindings file; module.cpp calls them in order.
#include "allocator/host_pool.h"

#include <pybind11/pybind11.h>

#include <string>

namespace dwgraph::bindings {

// A pool's statistics as a dict, keys prefixed with `prefix` ("" or "pool_").
pybind11::dict pool_stats_dict(const allocator::PoolStats& s, const std::string& prefix);

// `v` as an int64, refusing before any conversion what is not an integer (a bool, a float, a
// string: Python's int(True) would pass) and what does not fit: an ArgumentError naming
// `what` ("dwgraph.fp8.DelayedScaling: argument 'amax_history_len'") and the value's type.
int64_t python_int(const pybind11::handle& v, const std::string& what);

// An attribute of `o` (a new reference), or a null object where it is missing or its
// lookup raised (the error cleared; no AttributeError is made for a missing one). `name` is
// a string literal: its interned str is made once, not per read (the per-call checks).
pybind11::object optional_attr(const pybind11::handle& o, const char* name);

// OptimizerWatch.steady (dwgraph/_optim.py, optimizer_watch.cpp): nothing that selects a graph moved
// in `optimizer` since its watch last looked, but numbers a routed replay reads, which it
// then takes into the watch and the replay's buffer.
bool optimizer_steady(const pybind11::handle& optimizer, const pybind11::handle& watch);

void init_errors(pybind11::module_& m);
void init_log(pybind11::module_& m);
void init_nn(pybind11::module_& m);
void init_fp8(pybind11::module_& m);
void init_graphs(pybind11::module_& m);
void init_manager(pybind11::module_& m);  // after init_graphs
void init_watch(pybind11::module_& m);    // after init_graphs
void init_optimizer_watch(pybind11::module_& m);  // after init_graphs
void init_distributed(pybind11::module_& m);  // after init_nn

}  // namespace dwgraph::bindings
