// shoal._C.pipeline: schedules as data (shoal/pipeline/schedule.h) and shoal::pipeline::Pipeline
// over a torch.nn.Sequential of Python modules (python/shoal/pipeline.py; docs/python.md,
// "Pipelines").
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/nn/modules/container/sequential.h>

#include "bind.h"
#include "shoal/core/error.h"
#include "shoal/global/nn.h"
#include "shoal/pipeline/pipeline.h"
#include "shoal/pipeline/schedule.h"

namespace py = pybind11;

namespace shoal::python {
namespace {

namespace pp = shoal::pipeline;

// A Python object held from C++, whose last reference may go without the GIL.
std::shared_ptr<py::object> hold(py::object object) {
  return {new py::object(std::move(object)), [](py::object* o) {
            py::gil_scoped_acquire gil;
            delete o;
          }};
}

// Note [A pipeline of Python layers]
// The pipeline's runtime is C++'s: it cuts a torch::nn::Sequential into stages by parameter count,
// keeps this worker's, and runs its schedule's actions on the thread that called step(), with the
// transfers on comm's threads. A Python layer takes a C++ layer's place in that Sequential: a
// module over the Python module's own tensors (by their names, so the split counts the same
// parameters and a checkpoint names them as Python does), whose forward calls the Python module.
// step() releases the GIL; each layer's forward takes it back for the Python call, and so does
// the loss; between them, and in every transfer and wait, the GIL is free. A layer's backward is
// autograd's, on the same thread: its C++ nodes need no GIL, a Python autograd.Function's node
// takes it as in any PyTorch backward.
class PythonLayer : public Mirror {
 public:
  PythonLayer(py::object layer, const Named& parameters, const Named& buffers, const std::vector<std::string>& modules)
      : layer_(hold(std::move(layer))) {
    fill(parameters, buffers, modules);
  }
  torch::Tensor forward(torch::Tensor x) {
    py::gil_scoped_acquire gil;
    return (*layer_)(x).cast<torch::Tensor>();
  }

 private:
  std::shared_ptr<py::object> layer_;
};

// A Python layer made of global layers (a module of the program's own over shoal.global_.nn layers
// and ops): its forward takes and gives global tensors, through Python with the GIL, and the C++
// global layers it holds are its children at their paths, so that the pipeline finds their
// placement (and a stage's) as for a C++ layer of global layers.
class PythonGlobalLayer : public global::nn::Module {
 public:
  PythonGlobalLayer(py::object layer, const Placed& held) : layer_(hold(std::move(layer))) {
    for (const auto& [path, module] : held) place(*this, path, module);
  }
  global::GlobalTensor forward(const global::GlobalTensor& x) {
    py::gil_scoped_acquire gil;
    return (*layer_)(x).cast<global::GlobalTensor>();
  }

 private:
  std::shared_ptr<py::object> layer_;
};

pp::PipelineOptions options_of(int micro_batches, const std::string& schedule, int stages_per_worker,
                               const std::vector<int>& split, const std::vector<global::Placement>& placements,
                               const std::optional<pp::Schedule>& custom, std::optional<double> timeout,
                               const std::vector<global::Sbp>& batch) {
  pp::PipelineOptions options;
  options.batch = batch;
  options.micro_batches = micro_batches;
  options.schedule = pp::parse_schedule_kind(schedule);
  options.stages_per_worker = stages_per_worker;
  options.split = split;
  options.placements = placements;
  if (custom) options.custom_schedule = std::make_shared<const pp::Schedule>(*custom);
  options.timeout = deadline(timeout);
  return options;
}

class PythonPipeline {
 public:
  // Each layer: ("plain", module, parameters, buffers, submodules, []), ("global", module, [], [],
  // [], [(path, GlobalLayer)...]) for a Python module over global layers, or ("c++", None, [], [],
  // [], [("", GlobalLayer)]) for a global layer itself, which joins the Sequential as it is.
  using Layer = std::tuple<std::string, py::object, Named, Named, std::vector<std::string>, py::list>;
  PythonPipeline(const std::vector<Layer>& layers, const pp::PipelineOptions& options) {
    torch::nn::Sequential net;
    for (const auto& [kind, layer, parameters, buffers, modules, held] : layers) {
      if (kind == "plain") {
        net->push_back(std::make_shared<PythonLayer>(layer, parameters, buffers, modules));
      } else if (kind == "global") {
        net->push_back(std::make_shared<PythonGlobalLayer>(layer, placed_global_layers(held)));
      } else {
        held[0].cast<std::pair<std::string, GlobalLayer>>().second.push_back(net);
      }
    }
    py::gil_scoped_release no_gil;
    pipeline_ = std::make_unique<pp::Pipeline>(net, options);
  }
  pp::Pipeline& pipeline() { return *pipeline_; }

  torch::Tensor run(const at::Tensor& input, const at::Tensor& target, const py::function& loss, bool train) {
    auto held = hold(loss);
    if (pipeline_->is_global()) {
      pp::GlobalLossFunction call = [held](const global::GlobalTensor& output, const global::GlobalTensor& y) {
        py::gil_scoped_acquire gil;
        return (*held)(output, y).cast<global::GlobalTensor>();
      };
      py::gil_scoped_release no_gil;
      return train ? pipeline_->step(input, target, call) : pipeline_->evaluate(input, target, call);
    }
    pp::LossFunction call = [held](const torch::Tensor& output, const torch::Tensor& y) {
      py::gil_scoped_acquire gil;
      return (*held)(output, y).cast<torch::Tensor>();
    };
    py::gil_scoped_release no_gil;
    return train ? pipeline_->step(input, target, call) : pipeline_->evaluate(input, target, call);
  }

 private:
  std::unique_ptr<pp::Pipeline> pipeline_;
};

void bind_schedules(py::module_& m) {
  py::enum_<pp::ActionKind>(m, "ActionKind")
      .value("FORWARD", pp::ActionKind::kForward)
      .value("BACKWARD", pp::ActionKind::kBackward)
      .value("BACKWARD_INPUT", pp::ActionKind::kBackwardInput)
      .value("BACKWARD_WEIGHT", pp::ActionKind::kBackwardWeight)
      .value("SEND_ACTIVATION", pp::ActionKind::kSendActivation)
      .value("RECV_ACTIVATION", pp::ActionKind::kRecvActivation)
      .value("SEND_GRADIENT", pp::ActionKind::kSendGradient)
      .value("RECV_GRADIENT", pp::ActionKind::kRecvGradient);
  py::class_<pp::Action>(m, "Action")
      .def(py::init([](pp::ActionKind kind, int stage, int micro_batch) { return pp::Action{kind, stage, micro_batch}; }),
           py::arg("kind"), py::arg("stage"), py::arg("micro_batch"))
      .def_readwrite("kind", &pp::Action::kind)
      .def_readwrite("stage", &pp::Action::stage)
      .def_readwrite("micro_batch", &pp::Action::micro_batch)
      .def("short_name", &pp::Action::short_name)
      .def("describe", &pp::Action::describe)
      .def("__repr__", &pp::Action::short_name)
      .def("__eq__", [](const pp::Action& a, const pp::Action& b) { return a == b; });
  py::class_<pp::Schedule>(m, "Schedule")
      .def(py::init<>())
      .def_readwrite("name", &pp::Schedule::name)
      .def_readwrite("workers", &pp::Schedule::workers)
      .def_readwrite("stages", &pp::Schedule::stages)
      .def_readwrite("micro_batches", &pp::Schedule::micro_batches)
      .def_readwrite("stage_worker", &pp::Schedule::stage_worker)
      .def_readwrite("actions", &pp::Schedule::actions)
      .def("worker_of", &pp::Schedule::worker_of, py::arg("stage"))
      .def("splits_backward", &pp::Schedule::splits_backward)
      .def("describe", &pp::Schedule::describe);
  m.def("gpipe", &pp::gpipe, py::arg("workers"), py::arg("micro_batches"));
  m.def("one_f_one_b", &pp::one_f_one_b, py::arg("workers"), py::arg("micro_batches"));
  m.def("interleaved_one_f_one_b", &pp::interleaved_one_f_one_b, py::arg("workers"), py::arg("stages_per_worker"),
        py::arg("micro_batches"));
  m.def("zero_bubble_h1", &pp::zero_bubble_h1, py::arg("workers"), py::arg("micro_batches"));
  m.def(
      "make_schedule",
      [](const std::string& kind, int workers, int stages_per_worker, int micro_batches) {
        return pp::make_schedule(pp::parse_schedule_kind(kind), workers, stages_per_worker, micro_batches);
      },
      py::arg("kind"), py::arg("workers"), py::arg("stages_per_worker"), py::arg("micro_batches"));
  m.def("validate", &pp::validate, py::arg("schedule"));
  m.def("balanced_split", &pp::balanced_split, py::arg("weights"), py::arg("parts"));
  py::class_<pp::Costs>(m, "Costs")
      .def(py::init([](double forward, double backward, double backward_input, double backward_weight) {
             return pp::Costs{forward, backward, backward_input, backward_weight};
           }),
           py::arg("forward") = 1.0, py::arg("backward") = 2.0, py::arg("backward_input") = 1.0,
           py::arg("backward_weight") = 1.0)
      .def_readwrite("forward", &pp::Costs::forward)
      .def_readwrite("backward", &pp::Costs::backward)
      .def_readwrite("backward_input", &pp::Costs::backward_input)
      .def_readwrite("backward_weight", &pp::Costs::backward_weight);
  py::class_<pp::Simulation>(m, "Simulation")
      .def_readonly("makespan", &pp::Simulation::makespan)
      .def_readonly("bubble", &pp::Simulation::bubble)
      .def_readonly("start", &pp::Simulation::start)
      .def_readonly("peak_in_flight", &pp::Simulation::peak_in_flight);
  m.def("simulate", py::overload_cast<const pp::Schedule&, const pp::Costs&>(&pp::simulate), py::arg("schedule"),
        py::arg("costs") = pp::Costs{});
  m.def("simulate", py::overload_cast<const pp::Schedule&, const std::vector<pp::Costs>&>(&pp::simulate),
        py::arg("schedule"), py::arg("costs"));
}

}  // namespace

torch::nn::Module& pipeline_module(const py::handle& pipeline) {
  return pipeline.cast<PythonPipeline&>().pipeline().module();
}

void bind_pipeline(py::module_& m) {
  py::module_ pipeline = m.def_submodule("pipeline", "shoal::pipeline: schedules and the Pipeline");
  bind_schedules(pipeline);
  py::class_<pp::StageStepStats>(pipeline, "StageStepStats")
      .def_readonly("stage", &pp::StageStepStats::stage)
      .def_readonly("peak_stashed", &pp::StageStepStats::peak_stashed)
      .def_readonly("peak_stashed_bytes", &pp::StageStepStats::peak_stashed_bytes);
  py::class_<PythonPipeline>(pipeline, "Pipeline")
      .def(py::init([](const std::vector<PythonPipeline::Layer>& layers, int micro_batches, const std::string& schedule,
                       int stages_per_worker, const std::vector<int>& split,
                       const std::vector<global::Placement>& placements, const std::optional<pp::Schedule>& custom,
                       std::optional<double> timeout, const std::vector<global::Sbp>& batch) {
             return std::make_unique<PythonPipeline>(layers, options_of(micro_batches, schedule, stages_per_worker,
                                                                        split, placements, custom, timeout, batch));
           }),
           py::arg("layers"), py::arg("micro_batches"), py::arg("schedule"), py::arg("stages_per_worker"),
           py::arg("split"), py::arg("placements"), py::arg("custom_schedule"), py::arg("timeout"), py::arg("batch"))
      .def("is_global", [](PythonPipeline& p) { return p.pipeline().is_global(); })
      .def(
          "step", [](PythonPipeline& p, const at::Tensor& x, const at::Tensor& y, const py::function& loss) {
            return p.run(x, y, loss, true);
          },
          py::arg("input"), py::arg("target"), py::arg("loss"))
      .def(
          "evaluate", [](PythonPipeline& p, const at::Tensor& x, const at::Tensor& y, const py::function& loss) {
            return p.run(x, y, loss, false);
          },
          py::arg("input"), py::arg("target"), py::arg("loss"))
      .def("split", [](PythonPipeline& p) { return p.pipeline().split(); })
      .def("local_stages", [](PythonPipeline& p) { return p.pipeline().local_stages(); })
      .def("stages", [](PythonPipeline& p) { return p.pipeline().stages(); })
      .def("placement", [](PythonPipeline& p, int stage) { return p.pipeline().placement(stage); }, py::arg("stage"))
      .def("schedule", [](PythonPipeline& p) { return p.pipeline().schedule(); })
      .def("last_step_stats", [](PythonPipeline& p) { return p.pipeline().last_step_stats(); });
}

}  // namespace shoal::python
