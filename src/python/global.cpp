// shoal._C's global tensors: Placement, Sbp, GlobalTensor and the ops of shoal/global/ops.h, bound
// as they are (python/shoal/global_.py names them for Python; docs/python.md, "Global tensors").
// Every op and every method that may communicate (boxing, full(), backward) releases the GIL: the
// other workers' collectives and shoal's threads never need it.
#include <functional>
#include <sstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bind.h"
#include "shoal/global/nn.h"
#include "shoal/global/ops.h"
#include "shoal/global/placement.h"
#include "shoal/global/tensor.h"

namespace py = pybind11;

namespace shoal::python {
namespace {

namespace g = shoal::global;
using g::GlobalTensor;
using Sbps = std::vector<g::Sbp>;
using NoGil = py::call_guard<py::gil_scoped_release>;

void bind_placement(py::module_& m) {
  py::class_<g::Placement>(m, "Placement")
      .def(py::init<std::vector<int>>(), py::arg("ranks"))
      .def_static("all", &g::Placement::all)
      .def_static("mesh", py::overload_cast<std::vector<int64_t>>(&g::Placement::mesh), py::arg("shape"))
      .def_static("mesh", py::overload_cast<std::vector<int64_t>, std::vector<int>>(&g::Placement::mesh),
                  py::arg("shape"), py::arg("ranks"))
      .def_property_readonly("ranks", &g::Placement::ranks)
      .def_property_readonly("shape", &g::Placement::shape)
      .def_property_readonly("ndim", &g::Placement::ndim)
      .def("size", &g::Placement::size)
      .def("__contains__", &g::Placement::contains)
      .def("coordinate", &g::Placement::coordinate, py::arg("rank"))
      .def("__repr__", &g::Placement::describe)
      .def(py::self == py::self)
      .def(py::self != py::self);

  py::class_<g::Sbp>(m, "Sbp")
      .def_property_readonly("dim", &g::Sbp::dim)
      .def("is_split", &g::Sbp::is_split)
      .def("is_broadcast", &g::Sbp::is_broadcast)
      .def("is_partial_sum", &g::Sbp::is_partial_sum)
      .def("__repr__", &g::Sbp::describe)
      .def(py::self == py::self)
      .def(py::self != py::self);
  m.def("split", &g::split, py::arg("dim"));
  m.def("broadcast", &g::broadcast);
  m.def("partial_sum", &g::partial_sum);

  // One Sbp per mesh axis; where one is expected, Python may pass an Sbp (a line) or a list or
  // tuple of them.
  py::class_<g::NdSbp>(m, "NdSbp")
      .def(py::init<g::Sbp>())
      .def(py::init<Sbps>())
      .def_property_readonly("axes", &g::NdSbp::axes)
      .def("__len__", &g::NdSbp::size)
      .def("__repr__", &g::NdSbp::describe)
      .def(py::self == py::self)
      .def(py::self != py::self);
  py::implicitly_convertible<g::Sbp, g::NdSbp>();
  py::implicitly_convertible<py::list, g::NdSbp>();
  py::implicitly_convertible<py::tuple, g::NdSbp>();
}

void bind_tensor(py::module_& m) {
  py::class_<GlobalTensor>(m, "GlobalTensor")
      .def_static(
          "from_local",
          [](const at::Tensor& local, const g::Placement& placement, const g::NdSbp& sbp,
             const std::optional<std::vector<int64_t>>& shape) {
            return shape ? GlobalTensor::from_local(local, placement, sbp, *shape)
                         : GlobalTensor::from_local(local, placement, sbp);
          },
          py::arg("local"), py::arg("placement"), py::arg("sbp"), py::arg("shape") = py::none(), NoGil())
      .def_static(
          "from_full",
          [](const at::Tensor& full, const g::Placement& placement, const g::NdSbp& sbp) {
            return GlobalTensor::from_full(full, placement, sbp);
          },
          py::arg("full"), py::arg("placement"), py::arg("sbp"), NoGil())
      .def_property_readonly("shape", &GlobalTensor::shape)
      .def("dim", &GlobalTensor::dim)
      .def("size", &GlobalTensor::size, py::arg("dim"))
      .def("numel", &GlobalTensor::numel)
      .def_property_readonly("dtype", [](const GlobalTensor& t) { return py::reinterpret_borrow<py::object>(
                                            reinterpret_cast<PyObject*>(torch::getTHPDtype(t.dtype()))); })
      .def_property_readonly("placement", &GlobalTensor::placement)
      .def_property_readonly("sbp", &GlobalTensor::sbp)
      .def("is_local", &GlobalTensor::is_local)
      .def("to_local", &GlobalTensor::to_local)
      .def("full", &GlobalTensor::full, NoGil())
      .def(
          "to_global",
          [](const GlobalTensor& t, const std::optional<g::Placement>& placement, const g::NdSbp& sbp) {
            return t.to_global(placement ? *placement : t.placement(), sbp);
          },
          py::arg("placement") = py::none(), py::arg("sbp"), NoGil())
      .def(
          "requires_grad_", [](GlobalTensor& t, bool requires) -> GlobalTensor& { return t.requires_grad_(requires); },
          py::arg("requires_grad") = true, py::return_value_policy::reference_internal)
      .def_property_readonly("requires_grad", &GlobalTensor::requires_grad)
      .def_property_readonly("grad", [](const GlobalTensor& t) -> std::optional<GlobalTensor> {
        GlobalTensor grad = t.grad();
        if (!grad.defined()) return std::nullopt;
        return grad;
      })
      .def(
          "backward",
          [](const GlobalTensor& t, const std::optional<GlobalTensor>& gradient) {
            if (gradient) {
              t.backward(*gradient);
            } else {
              t.backward();
            }
          },
          py::arg("gradient") = py::none(), NoGil())
      .def("detach", &GlobalTensor::detach)
      .def("__repr__", &GlobalTensor::describe)
      .def(py::self + py::self, NoGil())
      .def(py::self - py::self, NoGil())
      .def(py::self * py::self, NoGil())
      .def(py::self / py::self, NoGil())
      .def("__add__", [](const GlobalTensor& a, double b) { return a + b; }, NoGil())
      .def("__radd__", [](const GlobalTensor& a, double b) { return a + b; }, NoGil())
      .def("__sub__", [](const GlobalTensor& a, double b) { return a - b; }, NoGil())
      .def("__mul__", [](const GlobalTensor& a, double b) { return a * b; }, NoGil())
      .def("__rmul__", [](const GlobalTensor& a, double b) { return a * b; }, NoGil())
      .def("__truediv__", [](const GlobalTensor& a, double b) { return a / b; }, NoGil())
      .def("__neg__", [](const GlobalTensor& a) { return -a; }, NoGil())
      .def("__matmul__", [](const GlobalTensor& a, const GlobalTensor& b) { return g::matmul(a, b); }, NoGil());

  // Factories: the value one process gets after the same torch.manual_seed.
  auto factory = [&m](const char* name, GlobalTensor (*make)(at::IntArrayRef, const g::Placement&, const g::NdSbp&,
                                                             const at::TensorOptions&)) {
    m.def(
        name,
        [make](const std::vector<int64_t>& shape, const g::Placement& placement, const g::NdSbp& sbp,
               std::optional<at::ScalarType> dtype) {
          return make(shape, placement, sbp, at::TensorOptions().dtype(dtype.value_or(at::kFloat)));
        },
        py::arg("shape"), py::arg("placement"), py::arg("sbp"), py::arg("dtype") = py::none(), NoGil());
  };
  m.def(
      "arange",
      [](int64_t end, const g::Placement& placement, const g::NdSbp& sbp) { return g::arange(end, placement, sbp); },
      py::arg("end"), py::arg("placement"), py::arg("sbp"), NoGil());
  factory("randn", &g::randn);
  factory("rand", &g::rand);
  factory("zeros", &g::zeros);
  factory("ones", &g::ones);
}

void bind_ops(py::module_& m) {
  using T = const GlobalTensor&;
  m.def("matmul", &g::matmul, py::arg("a"), py::arg("b"), NoGil());
  m.def("linear", &g::linear, py::arg("x"), py::arg("weight"), py::arg("bias") = GlobalTensor(), NoGil());
  m.def("relu", &g::relu, NoGil());
  m.def("gelu", &g::gelu, py::arg("x"), py::arg("approximate") = "none", NoGil());
  m.def("tanh", &g::tanh, NoGil());
  m.def("sigmoid", &g::sigmoid, NoGil());
  m.def("softmax", &g::softmax, py::arg("x"), py::arg("dim"), NoGil());
  m.def("log_softmax", &g::log_softmax, py::arg("x"), py::arg("dim"), NoGil());
  m.def(
      "sum", [](T x, std::optional<int64_t> dim, bool keepdim) { return dim ? g::sum(x, *dim, keepdim) : g::sum(x); },
      py::arg("x"), py::arg("dim") = py::none(), py::arg("keepdim") = false, NoGil());
  m.def(
      "mean", [](T x, std::optional<int64_t> dim, bool keepdim) { return dim ? g::mean(x, *dim, keepdim) : g::mean(x); },
      py::arg("x"), py::arg("dim") = py::none(), py::arg("keepdim") = false, NoGil());
  m.def(
      "max", [](T x, std::optional<int64_t> dim, bool keepdim) { return dim ? g::max(x, *dim, keepdim) : g::max(x); },
      py::arg("x"), py::arg("dim") = py::none(), py::arg("keepdim") = false, NoGil());
  m.def("reshape", [](T x, const std::vector<int64_t>& shape) { return g::reshape(x, shape); }, NoGil());
  m.def("view", [](T x, const std::vector<int64_t>& shape) { return g::view(x, shape); }, NoGil());
  m.def("transpose", &g::transpose, py::arg("x"), py::arg("dim0"), py::arg("dim1"), NoGil());
  m.def("permute", [](T x, const std::vector<int64_t>& dims) { return g::permute(x, dims); }, NoGil());
  m.def("cat", &g::cat, py::arg("tensors"), py::arg("dim"), NoGil());
  m.def("slice", &g::slice, py::arg("x"), py::arg("dim"), py::arg("start"), py::arg("end"), NoGil());
  m.def(
      "layer_norm",
      [](T x, const std::vector<int64_t>& shape, T weight, T bias, double eps) {
        return g::layer_norm(x, shape, weight, bias, eps);
      },
      py::arg("x"), py::arg("normalized_shape"), py::arg("weight") = GlobalTensor(), py::arg("bias") = GlobalTensor(),
      py::arg("eps") = 1e-5, NoGil());
  m.def("embedding", &g::embedding, py::arg("indices"), py::arg("weight"), NoGil());
  m.def("cross_entropy", &g::cross_entropy, py::arg("logits"), py::arg("target"), NoGil());
  m.def("dropout", &g::dropout, py::arg("x"), py::arg("p"), py::arg("training") = true, NoGil());
}

// Note [Global layers in Python]
// A global layer (shoal::global::nn) is a C++ module whose parameters are the local pieces of
// global tensors. Python holds it as it is (GlobalLayer) and shoal.global_.nn wraps it in a
// torch.nn.Module that lists those pieces, the C++ layer's own tensors, among its parameters, so
// that model.parameters() gives them to a torch optimizer and autograd fills their .grad. They
// are torch tensors and not Parameter objects: a Parameter made from a tensor is a new tensor,
// which the C++ layer's forward would not use. GradientSync and a checkpoint take the C++ layers
// themselves, placed at their Python paths in one C++ module, so that they sum the gradients and
// gather the whole values as they do for a C++ model of the same layers.
template <typename Impl>
GlobalLayer layer(std::shared_ptr<Impl> impl) {
  return {impl, [impl](const GlobalTensor& x) { return impl->forward(x); },
          [impl](torch::nn::Sequential& net) { net->push_back(impl); }};
}

// The C++ layers at their Python paths, in one module (GradientSync's and a checkpoint's).
std::shared_ptr<g::nn::Module> model_of(const std::vector<std::pair<std::string, GlobalLayer>>& layers) {
  auto root = std::make_shared<g::nn::Module>();
  // A dotted path nests, as the Python module's tree does.
  for (const auto& [path, l] : layers) place(*root, path, l.module);
  return root;
}

g::nn::GradientSyncOptions sync_options(const BucketOptions& buckets) {
  g::nn::GradientSyncOptions options;
  static_cast<BucketOptions&>(options) = buckets;
  return options;
}

class Sync {
 public:
  Sync(const std::vector<std::pair<std::string, GlobalLayer>>& layers, const BucketOptions& options)
      : model_(model_of(layers)), sync_(model_, sync_options(options)) {}
  std::vector<std::vector<int>> groups() const { return sync_.groups(); }

 private:
  std::shared_ptr<g::nn::Module> model_;
  g::nn::GradientSync sync_;
};

void bind_layers(py::module_& m) {
  py::class_<GlobalLayer>(m, "GlobalLayer")
      .def("forward", [](GlobalLayer& l, const GlobalTensor& x) { return l.forward(x); }, NoGil())
      .def("named_parameters",
           [](GlobalLayer& l) {
             Named found;
             for (const auto& item : l.module->named_parameters()) found.emplace_back(item.key(), item.value());
             return found;
           })
      .def("named_global_parameters", [](GlobalLayer& l) { return l.module->named_global_parameters(); })
      .def("train", [](GlobalLayer& l, bool mode) { l.module->train(mode); }, py::arg("mode"))
      .def("__repr__", [](GlobalLayer& l) {
        std::ostringstream text;
        l.module->pretty_print(text);
        return text.str();
      });
  // Construction draws the initial values from torch's generator, the same on every worker.
  m.def(
      "linear",
      [](int64_t in, int64_t out, const g::Placement& placement, const g::NdSbp& sbp, bool bias) {
        return layer(std::make_shared<g::nn::LinearImpl>(in, out, placement, sbp, bias));
      },
      py::arg("in_features"), py::arg("out_features"), py::arg("placement"), py::arg("sbp"), py::arg("bias"), NoGil());
  m.def(
      "embedding",
      [](int64_t count, int64_t dim, const g::Placement& placement, const g::NdSbp& sbp) {
        return layer(std::make_shared<g::nn::EmbeddingImpl>(count, dim, placement, sbp));
      },
      py::arg("num_embeddings"), py::arg("embedding_dim"), py::arg("placement"), py::arg("sbp"), NoGil());
  m.def(
      "layer_norm",
      [](int64_t dim, const g::Placement& placement, double eps) {
        return layer(std::make_shared<g::nn::LayerNormImpl>(dim, placement, eps));
      },
      py::arg("dim"), py::arg("placement"), py::arg("eps"), NoGil());
  m.def(
      "transformer_block",
      [](int64_t dim, int64_t heads, int64_t hidden, double dropout, const g::Placement& placement,
         const std::vector<int>& tensor_axes) {
        g::nn::TransformerBlockOptions options{dim, heads, hidden, dropout};
        g::nn::Layout layout{placement, tensor_axes};
        return layer(std::make_shared<g::nn::TransformerBlockImpl>(options, layout));
      },
      py::arg("dim"), py::arg("heads"), py::arg("hidden"), py::arg("dropout"), py::arg("placement"),
      py::arg("tensor_axes"), NoGil());
  py::class_<Sync>(m, "GradientSync")
      .def(py::init([](const std::vector<std::pair<std::string, GlobalLayer>>& layers, int64_t bucket_bytes,
                       int64_t first_bucket_bytes) {
             BucketOptions options;
             options.bucket_bytes = bucket_bytes;
             options.first_bucket_bytes = first_bucket_bytes;
             options.on_backward_error = raise_in_python;
             return std::make_unique<Sync>(layers, options);
           }),
           py::arg("layers"), py::arg("bucket_bytes"), py::arg("first_bucket_bytes"))
      .def("groups", &Sync::groups);
}

}  // namespace

Placed placed_global_layers(const py::handle& layers) {
  Placed placed;
  for (const py::handle item : layers) {
    auto [path, l] = item.cast<std::pair<std::string, GlobalLayer>>();
    placed.emplace_back(path, l.module);
  }
  return placed;
}

void bind_global(py::module_& m) {
  py::module_ global = m.def_submodule("global_", "shoal::global: placement, SBP, global tensors and their ops");
  bind_placement(global);
  bind_tensor(global);
  bind_ops(global);
  py::module_ nn = global.def_submodule("nn", "shoal::global::nn: global layers and GradientSync");
  bind_layers(nn);
}

}  // namespace shoal::python
