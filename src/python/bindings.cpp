// shoal._C: the Python extension over libshoal (docs/python.md). Python modules reach shoal's C++
// parts through it; the per-step work (autograd hooks, buckets, collectives, waits) stays in C++
// and runs without the GIL. Every call that can block releases the GIL first.
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <chrono>
#include <exception>
#include <optional>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/nn/module.h>

#include "shoal/comm/group.h"
#include "shoal/comm/work.h"
#include "shoal/core/error.h"
#include "shoal/data/sampler.h"
#include "shoal/dp/comm_hooks.h"
#include "shoal/dp/data_parallel.h"
#include "shoal/init.h"
#include "bind.h"

namespace py = pybind11;

namespace shoal::python {

// Note [A Python module's tensors in C++]
// DataParallel's C++ side works on a torch::nn::Module. A Python torch.nn.Module has none, but its
// parameters and buffers are LibTorch tensors: the Python layer passes them with their names, and
// a module of C++ is built that registers those very tensors (no copy) under the same names,
// nested at each '.', so that DataParallel's checks name them as Python does ("fc.weight"). Its
// hooks are then registered on the Python module's own tensors. The same C++ tree serves a
// checkpoint (with the submodules that hold no tensor, so that it is a C++ model's tree), the
// parameter servers (with each table's C++ module at its path) and a pipeline's layers
// (pipeline.cpp, whose layer also calls the Python module's forward).
std::pair<torch::nn::Module*, std::string> parent_at(torch::nn::Module& root, const std::string& path) {
  torch::nn::Module* module = &root;
  size_t start = 0;
  for (size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', start)) {
    const std::string name = path.substr(start, dot - start);
    torch::nn::Module* child = nullptr;
    for (const auto& item : module->named_children()) {
      if (item.key() == name) child = item.value().get();
    }
    module = child != nullptr ? child : module->register_module(name, std::make_shared<Mirror>()).get();
    start = dot + 1;
  }
  return {module, path.substr(start)};
}

void place(torch::nn::Module& root, const std::string& path, std::shared_ptr<torch::nn::Module> module) {
  auto [parent, name] = parent_at(root, path);
  parent->register_module(name, std::move(module));
}

void Mirror::fill(const Named& parameters, const Named& buffers, const std::vector<std::string>& modules,
                  const Placed& placed) {
  for (const auto& path : modules) {
    auto [parent, name] = parent_at(*this, path);
    bool exists = false;
    for (const auto& item : parent->named_children()) exists = exists || item.key() == name;
    if (!exists) parent->register_module(name, std::make_shared<Mirror>());
  }
  for (const auto& [path, module] : placed) place(*this, path, module);
  for (const auto& [path, tensor] : parameters) {
    auto [parent, name] = parent_at(*this, path);
    parent->register_parameter(name, tensor, tensor.requires_grad());
  }
  for (const auto& [path, tensor] : buffers) {
    auto [parent, name] = parent_at(*this, path);
    parent->register_buffer(name, tensor);
  }
}

std::shared_ptr<torch::nn::Module> mirror(const Named& parameters, const Named& buffers,
                                          const std::vector<std::string>& modules, const Placed& placed) {
  auto root = std::make_shared<Mirror>();
  root->fill(parameters, buffers, modules, placed);
  return root;
}

// Note [Errors inside backward]
// loss.backward() runs DataParallel's and GradientSync's hooks inside PyTorch's autograd engine,
// which hands a hook's exception to backward's caller as it is, and torch's binding of backward
// turns every C++ exception into a RuntimeError there, but one: torch's python_error, which
// carries a Python exception and raises it unchanged. So the hooks' BucketOptions::on_backward_error
// sets shoal's own exception for a shoal::Error (shoal.CommError, UsageError or Error, with the
// one-line text) and throws it inside a python_error; `except shoal.CommError` around backward
// then sees a lost peer as it does around a collective. Anything else leaves as it came. A global
// loss's backward() (global.cpp) runs the engine from C++ instead: what it raises, a python_error
// or a shoal::Error, reaches Python through pybind11 as shoal's exception either way.
void raise_in_python(std::exception_ptr thrown) {
  const char* type = nullptr;
  std::string text;
  try {
    std::rethrow_exception(thrown);
  } catch (const CommError& e) {
    type = "CommError";
    text = e.what();
  } catch (const UsageError& e) {
    type = "UsageError";
    text = e.what();
  } catch (const Error& e) {
    type = "Error";
    text = e.what();
  } catch (...) {
    return;
  }
  python_error error;
  {
    py::gil_scoped_acquire gil;
    PyErr_SetString(py::module_::import("shoal._C").attr(type).ptr(), text.c_str());
    error.persist();
  }
  throw error;
}

Duration deadline(const std::optional<double>& seconds) {
  if (!seconds) return kUnsetTimeout;
  if (!(*seconds > 0)) throw UsageError("timeout " + std::to_string(*seconds) + " s; expected a positive number of seconds or None");
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(*seconds));
}

namespace {

// DataParallel's C++ side for a Python module (shoal.DataParallel holds one).
class Replication {
 public:
  Replication(const Named& parameters, const Named& buffers, const DataParallelOptions& options)
      : module_(mirror(parameters, buffers)) {
    py::gil_scoped_release no_gil;  // it broadcasts and checks with the other workers
    replicator_ = dp::make_replicator(module_, options);
  }
  void before_forward(const std::optional<at::Tensor>& input) {
    py::gil_scoped_release no_gil;
    dp::before_forward(*replicator_, input ? &*input : nullptr);
  }
  void set_sync(bool sync) { dp::set_sync(*replicator_, sync); }
  bool sync() const { return dp::sync(*replicator_); }
  std::vector<std::vector<size_t>> bucket_assignment() const { return dp::bucket_assignment(*replicator_); }
  std::optional<GradientNoise> gradient_noise() const { return dp::gradient_noise(*replicator_); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  std::shared_ptr<dp::Replicator> replicator_;
};

comm::PointToPointOptions point_to_point(int tag, const std::optional<double>& timeout) {
  comm::PointToPointOptions options;
  options.tag = tag;
  options.timeout = deadline(timeout);
  return options;
}

// A collective's tensor argument: UsageError naming what came instead of a torch.Tensor (pybind11's
// own TypeError would list every signature over several lines).
at::Tensor tensor_of(const py::handle& value, const char* method, const char* argument) {
  if (!THPVariable_Check(value.ptr())) {
    throw UsageError(std::string("Group.") + method + ": " + argument + " is a " +
                     std::string(py::str(py::type::of(value).attr("__name__"))) + "; expected a torch.Tensor");
  }
  return value.cast<at::Tensor>();
}

comm::Sizes sizes_of(const std::optional<std::vector<int64_t>>& sizes) { return sizes ? *sizes : comm::Sizes(); }

// A collective that Python asked for with async_op: its Work, or None once it is done. The GIL is
// released while it is started or run.
template <typename Start, typename Run>
py::object maybe_async(bool async_op, Start start, Run run) {
  comm::Work work;
  {
    py::gil_scoped_release no_gil;
    if (async_op) {
      work = start();
    } else {
      run();
    }
  }
  return async_op ? py::cast(std::move(work)) : py::none();
}

void bind_comm(py::module_& m) {
  using comm::Group;
  using comm::Work;
  using Seconds = std::optional<double>;
  py::enum_<comm::ReduceOp>(m, "ReduceOp")
      .value("SUM", comm::ReduceOp::kSum)
      .value("AVG", comm::ReduceOp::kAvg)
      .value("MAX", comm::ReduceOp::kMax)
      .value("MIN", comm::ReduceOp::kMin);

  // Every wait releases the GIL: the other members' threads and shoal's own never need it.
  py::class_<Work>(m, "Work")
      .def(
          "wait", [](Work& work, Seconds timeout) {
            const Duration limit = deadline(timeout);
            py::gil_scoped_release no_gil;
            work.wait(limit);
          },
          py::arg("timeout") = py::none())
      .def("is_completed", &Work::is_completed)
      .def("result", &Work::result);

  py::class_<Group>(m, "Group")
      .def_static("single", &Group::single)
      .def("rank", &Group::rank)
      .def("size", &Group::size)
      .def("members", &Group::members)
      .def("is_broken", &Group::is_broken)
      .def(
          "all_reduce",
          [](Group& group, const py::handle& value, comm::ReduceOp op, Seconds timeout, bool async_op) -> py::object {
            at::Tensor tensor = tensor_of(value, "all_reduce", "tensor");
            comm::AllReduceOptions options;
            options.op = op;
            options.timeout = deadline(timeout);
            return maybe_async(async_op, [&] { return group.all_reduce_async(tensor, options); },
                               [&] { group.all_reduce(tensor, options); });
          },
          py::arg("tensor"), py::arg("op") = comm::ReduceOp::kSum, py::arg("timeout") = py::none(),
          py::arg("async_op") = false)
      .def(
          "broadcast",
          [](Group& group, const py::handle& value, int root, Seconds timeout, bool async_op) -> py::object {
            at::Tensor tensor = tensor_of(value, "broadcast", "tensor");
            comm::BroadcastOptions options;
            options.root = root;
            options.timeout = deadline(timeout);
            return maybe_async(async_op, [&] { return group.broadcast_async(tensor, options); },
                               [&] { group.broadcast(tensor, options); });
          },
          py::arg("tensor"), py::arg("root") = 0, py::arg("timeout") = py::none(), py::arg("async_op") = false)
      .def(
          "all_gather",
          [](Group& group, const py::handle& value, const std::optional<std::vector<int64_t>>& sizes, Seconds timeout) {
            const at::Tensor tensor = tensor_of(value, "all_gather", "tensor");
            comm::AllGatherOptions options;
            options.sizes = sizes_of(sizes);
            options.timeout = deadline(timeout);
            py::gil_scoped_release no_gil;
            return group.all_gather(tensor, options);
          },
          py::arg("tensor"), py::arg("sizes") = py::none(), py::arg("timeout") = py::none())
      .def(
          "reduce_scatter",
          [](Group& group, const py::handle& value, comm::ReduceOp op, const std::optional<std::vector<int64_t>>& sizes,
             Seconds timeout) {
            const at::Tensor input = tensor_of(value, "reduce_scatter", "input");
            comm::ReduceScatterOptions options;
            options.op = op;
            options.sizes = sizes_of(sizes);
            options.timeout = deadline(timeout);
            py::gil_scoped_release no_gil;
            return group.reduce_scatter(input, options);
          },
          py::arg("input"), py::arg("op") = comm::ReduceOp::kSum, py::arg("sizes") = py::none(),
          py::arg("timeout") = py::none())
      .def(
          "all_to_all",
          [](Group& group, const py::handle& value, const std::optional<std::vector<int64_t>>& send_sizes,
             const std::optional<std::vector<int64_t>>& recv_sizes, Seconds timeout) {
            const at::Tensor input = tensor_of(value, "all_to_all", "input");
            comm::AllToAllOptions options;
            options.send_sizes = sizes_of(send_sizes);
            options.recv_sizes = sizes_of(recv_sizes);
            options.timeout = deadline(timeout);
            py::gil_scoped_release no_gil;
            return group.all_to_all(input, options);
          },
          py::arg("input"), py::arg("send_sizes") = py::none(), py::arg("recv_sizes") = py::none(),
          py::arg("timeout") = py::none())
      .def(
          "send",
          [](Group& group, const py::handle& value, int dst, int tag, Seconds timeout) {
            const at::Tensor tensor = tensor_of(value, "send", "tensor");
            const comm::PointToPointOptions options = point_to_point(tag, timeout);
            py::gil_scoped_release no_gil;
            group.send(tensor, dst, options);
          },
          py::arg("tensor"), py::arg("dst"), py::arg("tag") = 0, py::arg("timeout") = py::none())
      .def(
          "recv",
          [](Group& group, const py::handle& value, int src, int tag, Seconds timeout) {
            at::Tensor tensor = tensor_of(value, "recv", "tensor");
            const comm::PointToPointOptions options = point_to_point(tag, timeout);
            py::gil_scoped_release no_gil;
            group.recv(tensor, src, options);
          },
          py::arg("tensor"), py::arg("src"), py::arg("tag") = 0, py::arg("timeout") = py::none())
      .def(
          "barrier",
          [](Group& group, Seconds timeout) {
            comm::BarrierOptions options;
            options.timeout = deadline(timeout);
            py::gil_scoped_release no_gil;
            group.barrier(options);
          },
          py::arg("timeout") = py::none())
      .def(
          "subgroup",
          [](const Group& group, std::vector<int> ranks) {
            py::gil_scoped_release no_gil;
            return group.subgroup(std::move(ranks));
          },
          py::arg("ranks"));

  // The job's world group (shoal::world()); UsageError before init().
  m.def("world", [] { return shoal::world(); });
}

void bind_data(py::module_& m) {
  using data::Sampler;
  py::enum_<data::LastBatch>(m, "LastBatch")
      .value("KEEP", data::LastBatch::kKeep)
      .value("DROP", data::LastBatch::kDrop)
      .value("PAD", data::LastBatch::kPad);
  // data::Sampler as it is (shoal/data/sampler.h); shoal.data builds the DataLoader on it.
  py::class_<Sampler>(m, "Sampler")
      .def(py::init([](int64_t dataset_size, int64_t batch_size, bool shuffle, data::LastBatch last_batch,
                       bool per_worker, uint64_t seed) {
             data::SamplerOptions options;
             options.batch_size = batch_size;
             options.shuffle = shuffle;
             options.last_batch = last_batch;
             options.per_worker = per_worker;
             options.seed = seed;
             return Sampler(dataset_size, options);
           }),
           py::arg("dataset_size"), py::arg("batch_size"), py::arg("shuffle"), py::arg("last_batch"),
           py::arg("per_worker"), py::arg("seed"))
      .def("copy", [](const Sampler& sampler) { return Sampler(sampler); })
      .def("set_epoch", &Sampler::set_epoch)
      .def("reshard", &Sampler::reshard)
      .def("epoch_done", &Sampler::epoch_done)
      .def("leased", &Sampler::leased)
      .def("batch", &Sampler::batch)
      .def("global_batch_at_cursor", &Sampler::global_batch_at_cursor)
      .def("advance", &Sampler::advance)
      .def("state_dict", &Sampler::state_dict)
      .def("check_state_dict", &Sampler::check_state_dict)
      .def("load_state_dict", &Sampler::load_state_dict)
      .def("batches_per_epoch", &Sampler::batches_per_epoch)
      .def("batches_remaining", &Sampler::batches_remaining)
      .def("global_batch_size", &Sampler::global_batch_size)
      .def("set_batch_size", &Sampler::set_batch_size)
      .def_property_readonly("epoch", &Sampler::epoch)
      .def_property_readonly("cursor", &Sampler::cursor)
      .def_property_readonly("rank", &Sampler::rank)
      .def_property_readonly("world_size", &Sampler::world_size)
      .def_property_readonly("dataset_size", &Sampler::dataset_size);
}

}  // namespace
}  // namespace shoal::python

PYBIND11_MODULE(_C, m) {
  namespace sp = shoal::python;
  m.doc() = "shoal's C++ core (docs/python.md); use the shoal package";

  // shoal.Error, and below it CommError and UsageError, carrying the C++ one-line texts.
  static py::exception<shoal::Error> error(m, "Error", PyExc_RuntimeError);
  static py::exception<shoal::CommError> comm_error(m, "CommError", error.ptr());
  static py::exception<shoal::UsageError> usage_error(m, "UsageError", error.ptr());
  py::register_exception_translator([](std::exception_ptr thrown) {
    try {
      if (thrown) std::rethrow_exception(thrown);
    } catch (const shoal::CommError& e) {
      comm_error(e.what());
    } catch (const shoal::UsageError& e) {
      usage_error(e.what());
    } catch (const shoal::Error& e) {
      error(e.what());
    }
  });

  m.def(
      "init",
      [](double connect_timeout, double timeout, int intra_op_threads, const std::string& master) {
        shoal::InitOptions options;
        options.master = master;
        options.connect_timeout = std::chrono::duration_cast<shoal::Duration>(std::chrono::duration<double>(connect_timeout));
        if (timeout > 0)
          options.timeout = std::chrono::duration_cast<shoal::Duration>(std::chrono::duration<double>(timeout));
        options.intra_op_threads = intra_op_threads;
        py::gil_scoped_release no_gil;
        shoal::init(options);
      },
      py::arg("connect_timeout"), py::arg("timeout"), py::arg("intra_op_threads"), py::arg("master"));
  m.def("is_initialized", &shoal::is_initialized);
  m.def("world_size", &shoal::world_size);
  m.def("rank", &shoal::rank);
  m.def("local_rank", &shoal::local_rank);
  m.def("is_main", &shoal::is_main);
  sp::bind_comm(m);
  sp::bind_data(m);
  sp::bind_checkpoint(m);
  sp::bind_elastic(m);
  sp::bind_ps(m);
  sp::bind_global(m);
  sp::bind_pipeline(m);

  // DataParallel's communication hooks (shoal/dp/comm_hooks.h), opaque: they run in C++.
  py::class_<shoal::dp::CommHook>(m, "CommHook");
  m.def("allreduce_hook", &shoal::dp::allreduce_hook);
  m.def("fp16_compress_hook", &shoal::dp::fp16_compress_hook);
  m.def("bf16_compress_hook", &shoal::dp::bf16_compress_hook);

  py::class_<sp::Replication>(m, "Replication")
      .def(py::init([](const sp::Named& parameters, const sp::Named& buffers, int64_t bucket_bytes,
                       int64_t first_bucket_bytes, bool find_unused_parameters, bool gradient_as_bucket_view,
                       bool broadcast_buffers, bool weigh_by_batch_share, int64_t batch_dim,
                       const std::optional<shoal::dp::CommHook>& comm_hook, bool measure_gradient_noise,
                       double gradient_noise_smoothing) {
             shoal::DataParallelOptions options;
             options.bucket_bytes = bucket_bytes;
             options.first_bucket_bytes = first_bucket_bytes;
             options.find_unused_parameters = find_unused_parameters;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.broadcast_buffers = broadcast_buffers;
             options.weigh_by_batch_share = weigh_by_batch_share;
             options.batch_dim = batch_dim;
             if (comm_hook) options.comm_hook = *comm_hook;
             options.measure_gradient_noise = measure_gradient_noise;
             options.gradient_noise_smoothing = gradient_noise_smoothing;
             options.on_backward_error = sp::raise_in_python;
             return std::make_unique<sp::Replication>(parameters, buffers, options);
           }),
           py::arg("parameters"), py::arg("buffers"), py::arg("bucket_bytes"), py::arg("first_bucket_bytes"),
           py::arg("find_unused_parameters"), py::arg("gradient_as_bucket_view"), py::arg("broadcast_buffers"),
           py::arg("weigh_by_batch_share"), py::arg("batch_dim"), py::arg("comm_hook"),
           py::arg("measure_gradient_noise"), py::arg("gradient_noise_smoothing"))
      .def("before_forward", &sp::Replication::before_forward, py::arg("input"))
      .def("set_sync", &sp::Replication::set_sync)
      .def("sync", &sp::Replication::sync)
      .def("bucket_assignment", &sp::Replication::bucket_assignment)
      .def("gradient_noise", &sp::Replication::gradient_noise);

  // Note [Measuring the gradient noise] (shoal/dp/gradient_noise.h).
  py::class_<shoal::GradientNoise>(m, "GradientNoise")
      .def_readonly("measurements", &shoal::GradientNoise::measurements)
      .def_readonly("batch", &shoal::GradientNoise::batch)
      .def_readonly("gradient_sqr", &shoal::GradientNoise::gradient_sqr)
      .def_readonly("variance", &shoal::GradientNoise::variance)
      .def("noise_scale", &shoal::GradientNoise::noise_scale)
      .def("gain", &shoal::GradientNoise::gain, py::arg("batch"), py::arg("base_batch"))
      .def("efficiency", &shoal::GradientNoise::efficiency, py::arg("batch"), py::arg("base_batch"))
      .def("__repr__", [](const shoal::GradientNoise& noise) {
        std::ostringstream text;
        text << "GradientNoise(measurements=" << noise.measurements << ", batch=" << noise.batch
             << ", gradient_sqr=" << noise.gradient_sqr << ", variance=" << noise.variance
             << ", noise_scale=" << noise.noise_scale() << ")";
        return text.str();
      });
}
