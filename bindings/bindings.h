#pragma once
// One init_* function per bindings file; module.cpp calls them in order.
#include "allocator/host_pool.h"

#include <pybind11/pybind11.h>

#include <string>

namespace dwgraph::bindings {

// A pool's statistics as a dict, keys prefixed with `prefix` ("" or "pool_").
pybind11::dict pool_stats_dict(const allocator::PoolStats& s, const std::string& prefix);

void init_errors(pybind11::module_& m);
void init_log(pybind11::module_& m);
void init_nn(pybind11::module_& m);
void init_fp8(pybind11::module_& m);
void init_graphs(pybind11::module_& m);
void init_manager(pybind11::module_& m);  // after init_graphs
void init_watch(pybind11::module_& m);    // after init_graphs
void init_distributed(pybind11::module_& m);  // after init_nn

}  // namespace dwgraph::bindings
