// shoal._C's checkpoints: shoal::save and shoal::load for a Python module, its optimizer and its
// loader (python/shoal/checkpoint.py calls them; docs/python.md, "Checkpoints").
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "bind.h"
#include "shoal/checkpoint/checkpoint.h"
#include "shoal/checkpoint/param_state.h"
#include "shoal/core/error.h"
#include "shoal/data/sampler.h"

namespace py = pybind11;

namespace shoal::python {

// Note [A Python optimizer's state in C++]
// shoal::save and shoal::load take a LibTorch optimizer, whose state a checkpoint holds in
// LibTorch's format (by position in the param groups, as Optimizer::save writes it). A Python
// optimizer's state is a dict per parameter. For the five types whose state shoal knows (SGD,
// Adam, AdamW, Adagrad, RMSprop), the Python layer builds a LibTorch optimizer of the same type
// over the same tensors, in the same param groups and with the same options, and moves the
// state's tensors (not copies) across by their names, which are the same in both languages
// (shoal/checkpoint/param_state.h). Saved this way, a Python optimizer's checkpoint is a C++
// program's, and loads there; loaded, the LibTorch optimizer's new state is moved back into the
// Python optimizer's dicts.
OptimizerMirror::OptimizerMirror(const std::string& type, const Groups& groups) : optimizer_(make(type, groups)) {}

py::object OptimizerMirror::state(const at::Tensor& parameter) const {
  auto state = checkpoint::param_state(*optimizer_, parameter);
  if (!state) return py::none();
  return py::make_tuple(state->step ? py::object(py::int_(*state->step)) : py::none(), state->fields);
}

void OptimizerMirror::give(const py::handle& python_optimizer) {
  const py::dict states = python_optimizer.attr("state");
  const py::list groups = python_optimizer.attr("param_groups");
  auto& mine = optimizer_->param_groups();
  for (size_t g = 0; g < mine.size() && g < groups.size(); ++g) {
    const py::dict group = groups[g];
    mine[g].options().set_lr(group["lr"].cast<double>());
    for (const py::handle parameter : py::list(group["params"])) {
      PyObject* entry = PyDict_GetItem(states.ptr(), parameter.ptr());  // borrowed; tensors hash by identity
      if (entry == nullptr || !PyDict_Check(entry) || PyDict_Size(entry) == 0) continue;
      checkpoint::ParamState state;
      for (const auto& [key, value] : py::reinterpret_borrow<py::dict>(entry)) {
        const std::string name = key.cast<std::string>();
        if (name == "step") {
          // A 0-dim or (1,) float tensor in torch 1.13's Adam, AdamW and Adagrad, an int in RMSprop.
          state.step = THPVariable_Check(value.ptr()) ? static_cast<int64_t>(value.cast<at::Tensor>().item<double>())
                                                      : value.cast<int64_t>();
        } else if (THPVariable_Check(value.ptr())) {
          state.fields[name] = value.cast<at::Tensor>();
        }
      }
      // SGD without momentum keeps {'momentum_buffer': None}: no state.
      if (state.fields.empty() && !state.step) continue;
      checkpoint::set_param_state(*optimizer_, parameter.cast<at::Tensor>(), state);
    }
  }
}

std::vector<double> OptimizerMirror::learning_rates() const {
  std::vector<double> rates;
  for (const auto& group : optimizer_->param_groups()) rates.push_back(group.options().get_lr());
  return rates;
}

void OptimizerMirror::set_learning_rates(const std::vector<double>& rates) {
  auto& groups = optimizer_->param_groups();
  for (size_t i = 0; i < groups.size() && i < rates.size(); ++i) groups[i].options().set_lr(rates[i]);
}

namespace {

double number(const py::dict& group, const char* key, double otherwise) {
  return group.contains(key) ? group[key].cast<double>() : otherwise;
}
bool flag(const py::dict& group, const char* key) { return group.contains(key) && group[key].cast<bool>(); }

template <typename Options>
Options adam_like(const py::dict& g) {
  Options o(number(g, "lr", 1e-3));
  if (g.contains("betas")) o.betas(g["betas"].cast<std::tuple<double, double>>());
  o.eps(number(g, "eps", 1e-8)).weight_decay(number(g, "weight_decay", o.weight_decay()));
  o.amsgrad(flag(g, "amsgrad"));
  return o;
}

template <typename Optimizer, typename Options>
std::unique_ptr<torch::optim::Optimizer> build(const OptimizerMirror::Groups& groups,
                                               Options (*options_of)(const py::dict&)) {
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (const auto& [params, options] : groups) {
    param_groups.emplace_back(params, std::make_unique<Options>(options_of(options)));
  }
  return std::make_unique<Optimizer>(std::move(param_groups), options_of(groups.empty() ? py::dict() : groups.front().second));
}

}  // namespace

torch::optim::SGDOptions sgd_options(const py::dict& g) {
  torch::optim::SGDOptions o(number(g, "lr", 1e-3));
  o.momentum(number(g, "momentum", 0)).dampening(number(g, "dampening", 0));
  o.weight_decay(number(g, "weight_decay", 0)).nesterov(flag(g, "nesterov"));
  return o;
}

torch::optim::AdagradOptions adagrad_options(const py::dict& g) {
  torch::optim::AdagradOptions o(number(g, "lr", 1e-2));
  o.lr_decay(number(g, "lr_decay", 0)).weight_decay(number(g, "weight_decay", 0));
  o.initial_accumulator_value(number(g, "initial_accumulator_value", 0)).eps(number(g, "eps", 1e-10));
  return o;
}

torch::optim::AdamOptions adam_options(const py::dict& g) { return adam_like<torch::optim::AdamOptions>(g); }

namespace {

torch::optim::AdamWOptions adamw_options(const py::dict& g) { return adam_like<torch::optim::AdamWOptions>(g); }

torch::optim::RMSpropOptions rmsprop_options(const py::dict& g) {
  torch::optim::RMSpropOptions o(number(g, "lr", 1e-2));
  o.alpha(number(g, "alpha", 0.99)).eps(number(g, "eps", 1e-8));
  o.weight_decay(number(g, "weight_decay", 0)).momentum(number(g, "momentum", 0)).centered(flag(g, "centered"));
  return o;
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> OptimizerMirror::make(const std::string& type, const Groups& groups) {
  using namespace torch::optim;  // NOLINT: the five optimizers' names read best unqualified
  if (type == "SGD") return build<SGD>(groups, sgd_options);
  if (type == "Adam") return build<Adam>(groups, adam_options);
  if (type == "AdamW") return build<AdamW>(groups, adamw_options);
  if (type == "Adagrad") return build<Adagrad>(groups, adagrad_options);
  if (type == "RMSprop") return build<RMSprop>(groups, rmsprop_options);
  throw UsageError("the optimizer is torch.optim." + type +
                   "; expected torch.optim.SGD, Adam, AdamW, Adagrad or RMSprop, whose state shoal saves");
}

namespace {

// The C++ module a checkpoint saves: the Python model's tree over its tensors with its global
// layers placed at their paths, the global layer itself when the model is one, or a pipeline's
// whole model (its own, which the shared_ptr does not own).
std::shared_ptr<torch::nn::Module> model_of(const Named& parameters, const Named& buffers,
                                            const std::vector<std::string>& modules, const py::list& global_layers,
                                            const py::object& pipeline) {
  if (!pipeline.is_none()) return {std::shared_ptr<torch::nn::Module>(), &pipeline_module(pipeline)};
  Placed placed = placed_global_layers(global_layers);
  if (placed.size() == 1 && placed[0].first.empty()) return placed[0].second;
  return mirror(parameters, buffers, modules, placed);
}

}  // namespace

void bind_checkpoint(py::module_& m) {
  py::class_<OptimizerMirror>(m, "OptimizerMirror")
      .def(py::init<const std::string&, const OptimizerMirror::Groups&>(), py::arg("type"), py::arg("groups"))
      .def("state", &OptimizerMirror::state, py::arg("parameter"))
      .def("give", &OptimizerMirror::give, py::arg("optimizer"))
      .def("learning_rates", &OptimizerMirror::learning_rates)
      .def("set_learning_rates", &OptimizerMirror::set_learning_rates, py::arg("rates"));

  m.def(
      "save",
      [](const std::string& path, const Named& parameters, const Named& buffers,
         const std::vector<std::string>& modules, const py::list& global_layers, const py::object& pipeline,
         OptimizerMirror* optimizer,
         data::Sampler* loader, const CheckpointExtras& extras, const std::optional<comm::Group>& group,
         std::optional<double> timeout) {
        auto module = model_of(parameters, buffers, modules, global_layers, pipeline);
        SaveOptions options;
        options.extras = extras;
        options.group = group;
        options.timeout = deadline(timeout);
        py::gil_scoped_release no_gil;
        if (optimizer == nullptr) {
          shoal::save(path, *module, options);
        } else if (loader == nullptr) {
          shoal::save(path, *module, optimizer->optimizer(), options);
        } else {
          shoal::save(path, *module, optimizer->optimizer(), *loader, options);
        }
      },
      py::arg("path"), py::arg("parameters"), py::arg("buffers"), py::arg("modules"), py::arg("global_layers"),
      py::arg("pipeline"), py::arg("optimizer"), py::arg("loader"),
      py::arg("extras"), py::arg("group"), py::arg("timeout"));

  m.def(
      "load",
      [](const std::string& path, const Named& parameters, const Named& buffers,
         const std::vector<std::string>& modules, const py::list& global_layers, const py::object& pipeline,
         OptimizerMirror* optimizer,
         data::Sampler* loader, const std::optional<comm::Group>& group, std::optional<double> timeout) {
        auto module = model_of(parameters, buffers, modules, global_layers, pipeline);
        CheckpointExtras extras;
        LoadOptions options;
        options.extras = &extras;
        options.group = group;
        options.timeout = deadline(timeout);
        py::gil_scoped_release no_gil;
        if (optimizer == nullptr) {
          shoal::load(path, *module, options);
        } else if (loader == nullptr) {
          shoal::load(path, *module, optimizer->optimizer(), options);
        } else {
          shoal::load(path, *module, optimizer->optimizer(), *loader, options);
        }
        return extras;
      },
      py::arg("path"), py::arg("parameters"), py::arg("buffers"), py::arg("modules"), py::arg("global_layers"),
      py::arg("pipeline"), py::arg("optimizer"), py::arg("loader"),
      py::arg("group"), py::arg("timeout"));
}

}  // namespace shoal::python
