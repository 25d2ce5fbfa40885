// shoal._datasets: shoal's demo datasets for the Python examples (shoal/datasets/, the library
// shoal::datasets; python/shoal/datasets.py). An extension of its own, as the datasets are a
// library of their own: outside the API, the examples' data.
#include <cstdint>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "shoal/core/error.h"
#include "shoal/datasets/synthetic_ctr.h"

namespace py = pybind11;

namespace {

using shoal::datasets::CtrBatch;
using shoal::datasets::SyntheticCtr;
using shoal::datasets::SyntheticCtrOptions;

py::tuple batch_of(const CtrBatch& b) { return py::make_tuple(b.ids, b.dense, b.label, b.probability); }

}  // namespace

PYBIND11_MODULE(_datasets, m) {
  m.doc() = "shoal's demo datasets (shoal/datasets/); use shoal.datasets";
  // shoal.UsageError, as shoal._C defines it, for the datasets' one-line errors.
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const shoal::UsageError& e) {
      PyErr_SetString(py::module_::import("shoal._C").attr("UsageError").ptr(), e.what());
    }
  });

  py::class_<SyntheticCtr>(m, "SyntheticCtr")
      .def(py::init([](uint64_t seed, int64_t size, int fields, int64_t vocabulary, double zipf, int dense, int factors,
                       double bias, double linear_scale, double dense_scale, double factor_scale, double id_decay) {
             SyntheticCtrOptions o;
             o.seed = seed;
             o.size = size;
             o.fields = fields;
             o.vocabulary = vocabulary;
             o.zipf = zipf;
             o.dense = dense;
             o.factors = factors;
             o.bias = bias;
             o.linear_scale = linear_scale;
             o.dense_scale = dense_scale;
             o.factor_scale = factor_scale;
             o.id_decay = id_decay;
             return SyntheticCtr(o);
           }),
           py::arg("seed"), py::arg("size"), py::arg("fields"), py::arg("vocabulary"), py::arg("zipf"),
           py::arg("dense"), py::arg("factors"), py::arg("bias"), py::arg("linear_scale"), py::arg("dense_scale"),
           py::arg("factor_scale"), py::arg("id_decay"))
      .def("__len__", &SyntheticCtr::size)
      .def(
          "get_batch",
          [](const SyntheticCtr& set, const std::vector<size_t>& indices) {
            CtrBatch b;
            {
              py::gil_scoped_release no_gil;
              b = set.get_batch(indices);
            }
            return batch_of(b);
          },
          py::arg("indices"))
      .def(
          "range",
          [](const SyntheticCtr& set, int64_t first, int64_t count) {
            CtrBatch b;
            {
              py::gil_scoped_release no_gil;
              b = set.range(first, count);
            }
            return batch_of(b);
          },
          py::arg("first"), py::arg("count"));
  m.def("auc", &shoal::datasets::auc, py::arg("scores"), py::arg("labels"));
  m.def("logloss", &shoal::datasets::logloss, py::arg("p"), py::arg("labels"));
}
