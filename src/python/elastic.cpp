// shoal._C's elastic training: shoal::elastic::State over a Python model, optimizer and loader,
// and shoal::elastic::run calling a Python function (python/shoal/elastic.py; docs/python.md,
// "Elastic jobs").
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "bind.h"
#include "shoal/comm/group.h"
#include "shoal/core/error.h"
#include "shoal/data/sampler.h"
#include "shoal/elastic/state.h"
#include "shoal/runtime/init.h"

namespace py = pybind11;

namespace shoal::python {
namespace {

// Note [Elastic recovery through Python]
// elastic::run calls the training function and recovers from what it raises: a CommError (a lost
// peer) or the signal that commit() agreed to change the world. Between the two sits Python, which
// turns every C++ exception into a Python one on the way out of commit() or a collective, and
// back into pybind11's error_already_set on the way into run's C++. So:
// - commit() and next_epoch() keep the C++ exception they raised (`pending`), and raise in Python
//   either shoal's own exception (CommError) or, for a change of the world, WorldChange, which
//   derives from BaseException so that the program's `except Exception` lets it through, as
//   KeyboardInterrupt; run's C++ side rethrows the kept exception as it was.
// - shoal.CommError raised by a collective the program called becomes shoal::CommError again.
// - An error inside backward reaches Python as shoal.CommError too: DataParallel's hooks through
//   Note [Errors inside backward] (bindings.cpp); a global loss's backward() runs autograd from
//   C++ and raises through pybind11. Any other error raised while the world is broken (a
//   RuntimeError from torch's backward through a global tensor's local piece) is taken as the
//   CommError it was.
// Anything else is the program's own error and leaves run() as it came.
class ElasticState {
 public:
  // `placed`: the model's global layers at their paths, which elastic::State refuses with its own
  // one line (their pieces differ between workers).
  ElasticState(const Named& parameters, const Named& buffers, const Placed& placed, OptimizerMirror& optimizer,
               data::Sampler& sampler, const elastic::StateOptions& options)
      : module_(mirror(parameters, buffers, {}, placed)), state_(*module_, optimizer.optimizer(), sampler, options) {}

  elastic::State& state() { return state_; }

  template <typename Step>
  void step(Step step) {
    try {
      py::gil_scoped_release no_gil;
      step(state_);
    } catch (const Error&) {
      pending_ = std::current_exception();
      throw;  // shoal.CommError or UsageError with its text
    } catch (...) {
      pending_ = std::current_exception();
      PyErr_SetString(world_change().ptr(), "the job's workers change at this commit; let it reach shoal.elastic.run");
      throw py::error_already_set();
    }
  }

  void run(const py::function& train) {
    py::gil_scoped_release no_gil;
    elastic::run(state_, [&] {
      py::gil_scoped_acquire gil;
      pending_ = nullptr;
      try {
        train();
      } catch (py::error_already_set& e) {
        if (pending_) {
          std::exception_ptr kept = std::exchange(pending_, nullptr);
          std::rethrow_exception(kept);
        }
        const py::object comm_error = py::module_::import("shoal._C").attr("CommError");
        if (e.matches(comm_error) || (shoal::is_initialized() && shoal::world().is_broken())) {
          throw CommError(py::str(e.value()).cast<std::string>());
        }
        throw;
      }
    });
  }

  // shoal._C.WorldChange (a BaseException).
  static py::object& world_change() {
    static py::object type;
    return type;
  }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  elastic::State state_;
  std::exception_ptr pending_;
};

// `limits` and `choose_every` are goodput's (shoal/dp/goodput.h's BatchLimits: base_batch,
// max_batch, min_local, max_local, max_accumulation).
elastic::BatchPolicy policy_of(const std::string& kind, int reference_world_size, int64_t warmup_steps,
                               const std::vector<int64_t>& limits, int64_t choose_every) {
  if (kind == "keep_global_batch") return elastic::BatchPolicy::keep_global_batch();
  if (kind == "scale_learning_rate") return elastic::BatchPolicy::scale_learning_rate(reference_world_size, warmup_steps);
  if (kind == "adascale") return elastic::BatchPolicy::adascale(reference_world_size);
  if (kind == "goodput") {
    if (limits.size() != 5) throw UsageError("BatchPolicy.goodput: expected 5 limits, got " + std::to_string(limits.size()));
    BatchLimits given;
    given.base_batch = limits[0];
    given.max_batch = limits[1];
    given.min_local = limits[2];
    given.max_local = limits[3];
    given.max_accumulation = static_cast<int>(limits[4]);
    return elastic::BatchPolicy::goodput(given, choose_every);
  }
  throw UsageError("BatchPolicy '" + kind + "'; expected keep_global_batch, scale_learning_rate, adascale or goodput");
}

}  // namespace

void bind_elastic(py::module_& m) {
  ElasticState::world_change() = py::reinterpret_borrow<py::object>(
      PyErr_NewException("shoal._C.WorldChange", PyExc_BaseException, nullptr));
  m.attr("WorldChange") = ElasticState::world_change();

  py::class_<ElasticState>(m, "ElasticState")
      .def(py::init([](const Named& parameters, const Named& buffers, const py::list& global_layers,
                       OptimizerMirror& optimizer, data::Sampler& sampler,
                       const std::string& policy, int reference_world_size, int64_t warmup_steps,
                       const std::vector<int64_t>& limits, int64_t choose_every, bool copy_parameters,
                       const std::string& checkpoint, int64_t checkpoint_every) {
             elastic::StateOptions options;
             options.policy = policy_of(policy, reference_world_size, warmup_steps, limits, choose_every);
             options.copy_parameters = copy_parameters;
             options.checkpoint = checkpoint;
             options.checkpoint_every = checkpoint_every;
             return std::make_unique<ElasticState>(parameters, buffers, placed_global_layers(global_layers), optimizer,
                                                   sampler, options);
           }),
           py::arg("parameters"), py::arg("buffers"), py::arg("global_layers"), py::arg("optimizer"), py::arg("sampler"),
           py::arg("policy"),
           py::arg("reference_world_size"), py::arg("warmup_steps"), py::arg("limits"), py::arg("choose_every"),
           py::arg("copy_parameters"),
           py::arg("checkpoint"), py::arg("checkpoint_every"),
           // The optimizer mirror and the sampler outlive the state, which holds them by reference.
           py::keep_alive<1, 5>(), py::keep_alive<1, 6>())
      .def("commit", [](ElasticState& s) { s.step([](elastic::State& state) { state.commit(); }); })
      .def("next_epoch", [](ElasticState& s) { s.step([](elastic::State& state) { state.next_epoch(); }); })
      .def_property_readonly("epoch", [](ElasticState& s) { return s.state().epoch(); })
      .def_property_readonly("version", [](ElasticState& s) { return s.state().version(); })
      .def_property_readonly("scaled_steps", [](ElasticState& s) { return s.state().scaled_steps(); })
      .def_property_readonly("gain", [](ElasticState& s) { return s.state().gain(); })
      .def_property_readonly("accumulation", [](ElasticState& s) { return s.state().accumulation(); })
      .def_property_readonly("batch_choice", [](ElasticState& s) {
        const BatchChoice& c = s.state().batch_choice();
        py::dict choice;
        choice["local_batch"] = c.local_batch;
        choice["accumulation"] = c.accumulation;
        choice["global_batch"] = c.global_batch;
        choice["throughput"] = c.throughput;
        choice["efficiency"] = c.efficiency;
        choice["goodput"] = c.goodput;
        return choice;
      })
      .def("value", [](ElasticState& s, const std::string& name) -> std::optional<at::Tensor> {
        const at::Tensor& value = s.state().value(name);
        if (!value.defined()) return std::nullopt;
        return value;
      })
      .def("set_value", [](ElasticState& s, const std::string& name, const at::Tensor& value) {
        s.state().value(name) = value;
      })
      .def("on_reset", [](ElasticState& s, const py::function& callback) {
        // Held so that the last reference goes with the GIL held, wherever C++ drops it.
        std::shared_ptr<py::function> held(new py::function(callback), [](py::function* f) {
          py::gil_scoped_acquire gil;
          delete f;
        });
        s.state().on_reset([held] {
          py::gil_scoped_acquire gil;
          (*held)();
        });
      })
      .def("set_base_learning_rates", [](ElasticState& s, std::vector<double> rates) {
        s.state().set_base_learning_rates(std::move(rates));
      })
      .def("run", &ElasticState::run, py::arg("train"));
}

}  // namespace shoal::python
