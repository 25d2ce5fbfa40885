// shoal._C's parameter servers: shoal::ps::Optimizer over a Python model and shoal::ps::Embedding
// as the table inside a Python module (python/shoal/ps.py; docs/python.md, "Parameter servers").
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bind.h"
#include "shoal/core/error.h"
#include "shoal/data/sampler.h"
#include "shoal/ps/ps.h"

namespace py = pybind11;

namespace shoal::python {
namespace {

// A Python model's parameter-server optimizer: the C++ module over its tensors, with each Python
// ps.Embedding's C++ table at its path (so the table's name on the servers is the Python module's
// path, as in C++), and the C++ optimizer over it, which holds both.
class Servers {
 public:
  Servers(const Named& parameters, const Placed& tables, const std::string& kind, const py::dict& options,
          ps::ServerOptions servers)
      : module_(mirror(parameters, {}, {}, tables)) {
    auto make = [&](const auto& torch_options) {
      py::gil_scoped_release no_gil;  // it registers with the servers and takes the first worker's values
      optimizer_ = std::make_unique<ps::Optimizer>(*module_, torch_options, servers);
    };
    if (kind == "SGD") {
      make(sgd_options(options));
    } else if (kind == "Adagrad") {
      make(adagrad_options(options));
    } else if (kind == "Adam") {
      make(adam_options(options));
    } else {
      throw UsageError("shoal.ps.Optimizer: the optimizer is torch.optim." + kind +
                       "; expected torch.optim.SGD, Adagrad or Adam, whose rules the servers apply");
    }
  }
  ps::Optimizer& optimizer() { return *optimizer_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::unique_ptr<ps::Optimizer> optimizer_;
};

ps::RowInit row_init(const std::string& kind, double a, double b) {
  if (kind == "zeros") return ps::RowInit::zeros();
  if (kind == "uniform") return ps::RowInit::uniform(a, b);
  if (kind == "normal") return ps::RowInit::normal(a, b);
  throw UsageError("shoal.ps.Embedding: init '" + kind + "'; expected zeros, uniform or normal");
}

}  // namespace

void bind_ps(py::module_& m) {
  py::class_<ps::EmbeddingImpl, std::shared_ptr<ps::EmbeddingImpl>>(m, "PsEmbedding")
      .def(py::init([](int64_t num_embeddings, int64_t embedding_dim, const std::string& init, double a, double b,
                       uint64_t seed) {
             ps::EmbeddingOptions options(num_embeddings, embedding_dim);
             options.init(row_init(init, a, b)).seed(seed);
             return std::make_shared<ps::EmbeddingImpl>(options);
           }),
           py::arg("num_embeddings"), py::arg("embedding_dim"), py::arg("init"), py::arg("a"), py::arg("b"),
           py::arg("seed"))
      .def(
          "forward",
          [](ps::EmbeddingImpl& table, const at::Tensor& ids) {
            py::gil_scoped_release no_gil;  // it pulls the batch's rows from the servers
            return table.forward(ids);
          },
          py::arg("ids"))
      .def_property_readonly("num_embeddings", [](const ps::EmbeddingImpl& t) { return t.options().num_embeddings(); })
      .def_property_readonly("embedding_dim", [](const ps::EmbeddingImpl& t) { return t.options().embedding_dim(); });

  py::class_<Servers>(m, "PsOptimizer")
      .def(py::init([](const Named& parameters, const std::vector<std::pair<std::string, std::shared_ptr<ps::EmbeddingImpl>>>& tables,
                       const std::string& kind, const py::dict& options, const std::string& mode,
                       std::optional<double> timeout, bool measure_gradient_noise,
                       double gradient_noise_smoothing, int64_t batch_size) {
             Placed placed(tables.begin(), tables.end());
             ps::ServerOptions servers;
             servers.mode = mode;
             servers.timeout = deadline(timeout);
             servers.measure_gradient_noise = measure_gradient_noise;
             servers.gradient_noise_smoothing = gradient_noise_smoothing;
             servers.batch_size = batch_size;
             return std::make_unique<Servers>(parameters, placed, kind, options, servers);
           }),
           py::arg("parameters"), py::arg("tables"), py::arg("kind"), py::arg("options"), py::arg("mode"),
           py::arg("timeout"), py::arg("measure_gradient_noise"), py::arg("gradient_noise_smoothing"),
           py::arg("batch_size"))
      .def("zero_grad", [](Servers& s) { s.optimizer().zero_grad(); })
      .def("step",
           [](Servers& s) {
             py::gil_scoped_release no_gil;
             s.optimizer().step();
           })
      .def("train_on", [](Servers& s, data::Sampler& sampler) { s.optimizer().train_on(sampler); },
           py::arg("sampler"), py::keep_alive<1, 2>())
      .def("steps", [](Servers& s) { return s.optimizer().steps(); })
      .def("staleness", [](Servers& s) { return s.optimizer().staleness(); })
      .def("gradient_noise", [](Servers& s) { return s.optimizer().gradient_noise(); });
}

}  // namespace shoal::python
