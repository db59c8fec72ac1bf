#pragma once
// One init_* function per bindings file; module.cpp calls them in order.
#include <pybind11/pybind11.h>

namespace dwgraph::bindings {

void init_errors(pybind11::module_& m);
void init_log(pybind11::module_& m);
void init_nn(pybind11::module_& m);
void init_graphs(pybind11::module_& m);
void init_manager(pybind11::module_& m);  // after init_graphs

}  // namespace dwgraph::bindings
