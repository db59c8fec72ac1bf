// Bindings of the graph backends and pools (dwgraph._C.graphs); the Python wrapper with
// the capture context manager is bindings/python/dwgraph/graphs.py.
#include "bindings/bindings.h"

#include "common/check.h"
#include "graphs/capture_dispatch.h"
#include "graphs/graph.h"
#include "graphs/host_calls.h"

#include <pybind11/functional.h>

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace dwgraph::bindings {
py::dict pool_stats_dict(const allocator::PoolStats& s, const std::string& prefix) {
  py::dict d;
  d[py::str(prefix + "reserved_bytes")] = s.reserved_bytes;
  d[py::str(prefix + "allocated_bytes")] = s.allocated_bytes;
  d[py::str(prefix + "peak_allocated_bytes")] = s.peak_allocated_bytes;
  d[py::str(prefix + "live_blocks")] = s.live_blocks;
  d[py::str(prefix + "num_allocations")] = s.num_allocations;
  return d;
}

void init_graphs(py::module_& parent) {
  auto m = parent.def_submodule("graphs", "Graph backends and private pools");
  using graphs::Graph;
  using graphs::GraphPool;

  // `with pool._allocation_scope():` routes this thread's (CUDA: this stream's) allocations
  // on the pool's device to the pool outside any capture, from __enter__ to __exit__ (the
  // host routing is thread-local, so it starts and ends on the thread of the with block).
  // Internal (dwgraph.eager_memory, on a fresh pool): on a pool with graphs, such a block
  // could alias memory their replays write.
  struct AllocationScopeHandle {
    std::shared_ptr<GraphPool> pool;
    std::unique_ptr<GraphPool::AllocationScope> scope;
  };
  py::class_<AllocationScopeHandle>(m, "AllocationScope")
      .def("__enter__",
           [](AllocationScopeHandle& h) -> AllocationScopeHandle& {
             DWGRAPH_CHECK_STATE(!h.scope, "dwgraph GraphPool._allocation_scope(): the scope is already entered; "
                                 "expected one `with` per scope");
             h.scope = h.pool->allocation_scope();
             return h;
           }, py::return_value_policy::reference)
      .def("__exit__", [](AllocationScopeHandle& h, const py::args&) {
        h.scope.reset();
        return false;
      });

  py::class_<GraphPool, std::shared_ptr<GraphPool>>(m, "GraphPool")
      .def_property_readonly("device", &GraphPool::device)
      .def("stats", [](const GraphPool& p) { return pool_stats_dict(p.stats(), ""); })
      .def("_allocation_scope",
           [](const std::shared_ptr<GraphPool>& p) { return AllocationScopeHandle{p, nullptr}; })
      // Test-only negative control: replays in any order, corrupting as CUDA would.
      .def("_set_order_checks", [](GraphPool& p, bool on) { p.order().set_enforced(on); }, py::arg("on"));

  m.def("graph_pool_handle", &graphs::make_pool, py::arg("device"));
  m.def("graph_pool_from_handle", &graphs::pool_from_handle, py::arg("handle"));

  // Note [Host work around a replay] (graphs/host_calls.h).
  m.def("capturing", &graphs::capturing);
  // Note [A call that raised] (graphs/recorder.cpp): a refusal the front end raises into the
  // region's code (a host read without a dispatcher call) is noted on this thread's capture.
  m.def("note_refused", [](const std::string& what) { graphs::detail::note_refused_here(what); }, py::arg("what"));
  m.def(
      "replay_buffer",
      [](const at::Tensor& owner, const std::string& tag, std::vector<int64_t> sizes, at::ScalarType dtype,
         std::function<void(const at::Tensor&)> fill) {
        return graphs::replay_buffer(owner, tag, sizes, dtype, std::move(fill));
      },
      py::arg("owner"), py::arg("tag"), py::arg("sizes"), py::arg("dtype"), py::arg("fill"));
  m.def("after_replay", &graphs::after_replay, py::arg("fn"), py::arg("state_only") = false);

  py::class_<Graph>(m, "Graph")
      .def(py::init([](c10::Device device) { return graphs::make_graph(device); }), py::arg("device"))
      .def_property_readonly("device", &Graph::device)
      // Released: on CUDA it runs a backward through the engine (Note [torch's cuBLAS handles
      // before a capture]), which refuses a caller holding the GIL.
      .def("capture_begin", &Graph::capture_begin, py::arg("pool") = nullptr, py::call_guard<py::gil_scoped_release>())
      .def("capture_end", &Graph::capture_end)
      .def("capture_abort", &Graph::capture_abort)
      .def("replay", &Graph::replay, py::call_guard<py::gil_scoped_release>())
      .def("reset", &Graph::reset)
      .def_property("name", &Graph::name, &Graph::set_name)
      .def_property_readonly("is_captured", &Graph::is_captured)
      .def_property_readonly("is_capturing", &Graph::is_capturing)
      .def_property_readonly("pool", &Graph::pool)
      .def_property_readonly("num_kernels", &Graph::num_kernels)
      .def_property_readonly("num_before_calls", &Graph::num_before_calls)
      .def_property_readonly("num_after_calls", &Graph::num_after_calls)
      .def("recorded_calls", &Graph::recorded_calls)
      .def("storages",
           [](const Graph& g) {
             py::list out;
             for (const auto& s : g.storages()) {
               py::dict d;
               d["ownership"] = allocator::to_string(s.ownership);
               d["nbytes"] = s.nbytes;
               d["role"] = s.role;
               d["alive"] = s.alive;
               out.append(d);
             }
             return out;
           })
      .def(
          "set_role",
          [](Graph& g, const at::Tensor& t, const std::string& role, bool persistent) {
            g.set_role(t.storage(), role, persistent);
          },
          py::arg("tensor"), py::arg("role"), py::arg("persistent") = false);
}

}  // namespace dwgraph::bindings
