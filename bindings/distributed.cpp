// Bindings of dwgraph::distributed (dwgraph._C.distributed); the Python front end is the
// package bindings/python/dwgraph/distributed.
#include "bindings/bindings.h"

#include "distributed/data_parallel.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

namespace dwgraph::bindings {
namespace {

using distributed::DataParallelReducer;
using distributed::ReducedModule;
using distributed::ReducedParameter;

// torch.distributed.ProcessGroup is torch's pybind11 class of c10d::ProcessGroup, held by
// intrusive_ptr (torch/csrc/utils/pybind.h declares the holder).
c10::intrusive_ptr<c10d::ProcessGroup> as_group(const py::object& group) {
  return group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
}

// Gradient buffers from Python: None (no .grad yet) becomes an undefined tensor.
using Buffers = std::vector<std::optional<at::Tensor>>;

std::vector<at::Tensor> defined_or_empty(const Buffers& in) {
  std::vector<at::Tensor> out;
  out.reserve(in.size());
  for (const auto& t : in) out.push_back(t.value_or(at::Tensor()));
  return out;
}

}  // namespace

void init_distributed(py::module_& parent) {
  auto m = parent.def_submodule("distributed", "Reductions of deferred weight gradients");

  py::class_<DataParallelReducer, std::shared_ptr<DataParallelReducer>>(m, "DataParallelReducer")
      .def(py::init([](const py::object& group, const py::list& params, const py::list& modules,
                       int64_t bucket_cap_bytes) {
             std::vector<ReducedParameter> ps;
             for (const auto& item : params) {
               const auto d = item.cast<py::dict>();
               ReducedParameter p;
               p.param = d["param"].cast<at::Tensor>();
               p.name = d["name"].cast<std::string>();
               p.fused = d["fused"].cast<bool>();
               p.grad_dtype = d["grad_dtype"].cast<at::ScalarType>();
               p.owners = d["owners"].cast<std::vector<size_t>>();
               ps.push_back(std::move(p));
             }
             std::vector<ReducedModule> ms;
             for (const auto& item : modules) {
               const auto d = item.cast<py::dict>();
               ReducedModule mod;
               mod.name = d["name"].cast<std::string>();
               if (!d["store"].is_none()) mod.store = d["store"].cast<std::shared_ptr<ops::WgradStore>>();
               mod.params = d["params"].cast<std::vector<size_t>>();
               ms.push_back(std::move(mod));
             }
             return std::make_shared<DataParallelReducer>(as_group(group), std::move(ps), std::move(ms),
                                                          bucket_cap_bytes);
           }),
           py::arg("process_group"), py::arg("params"), py::arg("modules"), py::arg("bucket_cap_bytes"))
      // Everything that launches, waits on or drops collectives runs without the GIL: gloo's
      // worker thread may need it to destroy a finished work while holding the lock that
      // launching takes (as torch's own collective bindings do).
      .def("begin_forward", &DataParallelReducer::begin_forward, py::arg("sync"))
      .def(
          "on_landed",
          [](DataParallelReducer& r, size_t module, const Buffers& buffers) {
            r.on_landed(module, defined_or_empty(buffers));
          },
          py::arg("module"), py::arg("buffers"), py::call_guard<py::gil_scoped_release>())
      .def(
          "finish",
          [](DataParallelReducer& r, const std::vector<Buffers>& buffers) {
            std::vector<std::vector<at::Tensor>> all;
            for (const auto& b : buffers) all.push_back(defined_or_empty(b));
            r.finish(all);
          },
          py::arg("buffers"), py::call_guard<py::gil_scoped_release>())
      .def("abandon", &DataParallelReducer::abandon, py::call_guard<py::gil_scoped_release>())
      .def("pending", &DataParallelReducer::pending)
      .def("ready_counts", &DataParallelReducer::ready_counts)
      .def_property_readonly("num_buckets", &DataParallelReducer::num_buckets)
      .def_property_readonly("num_launched", &DataParallelReducer::num_launched);

  m.def(
      "count_agreeing",
      [](const py::object& group, bool ok, const at::Device& device) {
        const auto g = as_group(group);
        const py::gil_scoped_release no_gil;
        return distributed::count_agreeing(g, ok, device);
      },
      py::arg("process_group"), py::arg("ok"), py::arg("device"));
}

}  // namespace dwgraph::bindings
