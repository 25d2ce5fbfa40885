// save and load as collectives: who writes, who reads, and how every worker learns the outcome.
// The file's container is in container.cpp, its content in contents.cpp, the atomic write in
// atomic_file.cpp.
#include "shoal/checkpoint/checkpoint.h"

#include <algorithm>
#include <exception>
#include <functional>
#include <string_view>

#include <c10/util/Exception.h>

#include "atomic_file.h"
#include "collective.h"
#include "container.h"
#include "contents.h"
#include "core/error_text.h"
#include "file.h"
#include "whole.h"
#include "shoal/core/error.h"
#include "shoal/runtime/init.h"

namespace shoal {
namespace {

// The root of every exchange: the group's first worker writes and reads the file.
constexpr int kRoot = 0;

// A file travels in pieces: each broadcast then has its own deadline, and no tensor needs
// more than 2^31 elements.
constexpr int64_t kPieceBytes = int64_t{64} << 20;

void check_path(const std::string& path, const char* operation) {
  if (path.empty()) throw UsageError(std::string(operation) + ": the path is empty; expected a file name");
}

comm::Group group_of(const std::optional<comm::Group>& group, const char* operation) {
  if (group) return *group;
  if (!is_initialized()) {
    throw UsageError(std::string(operation) +
                     ": the job is not known yet: call shoal::init() first, or pass options.group "
                     "(comm::Group::single() for a process on its own)");
  }
  return world();
}

// Gives every member the root's outcome and the bytes that go with it: its error message when
// `ok` is false, otherwise whatever the operation sends (the file, for load). The other
// members' `ok` and `bytes` are overwritten. Waiting for the root is what makes save return
// only once the file is complete, and load fail on every worker when the root can't read.
void share_outcome(comm::Group& group, bool& ok, std::string& bytes, Duration timeout) {
  comm::BroadcastOptions options;
  options.root = kRoot;
  options.timeout = timeout;
  auto outcome = at::tensor({static_cast<int64_t>(ok), static_cast<int64_t>(bytes.size())}, at::kLong);
  group.broadcast(outcome, options);
  ok = outcome[0].item<int64_t>() != 0;
  const int64_t size = outcome[1].item<int64_t>();
  if (group.rank() != kRoot) bytes.assign(static_cast<size_t>(size), '\0');
  for (int64_t offset = 0; offset < size; offset += kPieceBytes) {
    // A view of the string itself: the root sends from it, the others receive into it.
    auto piece = at::from_blob(&bytes[static_cast<size_t>(offset)], {std::min(kPieceBytes, size - offset)}, at::kByte);
    group.broadcast(piece, options);
  }
}

// share_outcome, with the checkpoint and what was waited for named in a CommError.
void share_outcome(comm::Group& group, bool& ok, std::string& bytes, const std::string& path, const char* waiting_for,
                   Duration timeout) {
  try {
    share_outcome(group, ok, bytes, timeout);
  } catch (const CommError& error) {
    throw CommError("checkpoint " + path + ": waiting for worker " + std::to_string(kRoot) + " " + waiting_for +
                    ": " + error.what());
  }
}

}  // namespace

namespace checkpoint {

void save_payload(const std::string& path, comm::Group& group, const std::function<std::string()>& make_payload,
                  Duration timeout) {
  bool ok = true;
  std::string error;
  // Kept to rethrow on the root as it was, when it is not shoal's or LibTorch's (bad_alloc).
  std::exception_ptr unexpected;
  if (group.rank() == kRoot) {
    try {
      checkpoint::write_file(path, make_payload());
    } catch (const UsageError& e) {
      ok = false;
      error = e.what();
    } catch (const c10::Error& e) {
      ok = false;
      error = "checkpoint " + path + " could not be saved: " + one_line(e);
    } catch (const std::exception& e) {
      ok = false;
      error = "checkpoint " + path + " could not be saved: the main worker failed: " + one_line(e);
      unexpected = std::current_exception();
    }
  }
  if (group.size() > 1) share_outcome(group, ok, error, path, "to write it", timeout);
  if (unexpected) std::rethrow_exception(unexpected);
  if (!ok) throw UsageError(error);
}

std::string read_payload(const std::string& path, comm::Group& group, Duration timeout) {
  bool ok = true;
  std::string bytes;  // the file, or the root's error message when !ok
  std::string_view payload;
  if (group.rank() == kRoot) {
    // Checked before sending, so that a bad file costs one message rather than its size.
    try {
      bytes = checkpoint::read_whole_file(path);
      payload = checkpoint::open_container(path, bytes);
    } catch (const UsageError& e) {
      ok = false;
      bytes = e.what();
    }
  }
  if (group.size() > 1) share_outcome(group, ok, bytes, path, "to read it", timeout);
  if (!ok) throw UsageError(bytes);
  // The others check their copy too: the checksum is cheap next to deserializing.
  if (group.rank() != kRoot) payload = checkpoint::open_container(path, bytes);
  return std::string(payload);
}

void agree(comm::Group& group, std::string error, Duration timeout) {
  if (group.size() == 1) {
    if (!error.empty()) throw UsageError(error);
    return;
  }
  auto failing =
      at::tensor({static_cast<int64_t>(error.empty() ? group.size() : group.rank())}, at::kLong);
  comm::AllReduceOptions reduce;
  reduce.op = comm::ReduceOp::kMin;
  reduce.timeout = timeout;
  group.all_reduce(failing, reduce);
  const int first_failing = static_cast<int>(failing.item<int64_t>());
  if (first_failing == group.size()) return;
  comm::BroadcastOptions options;
  options.root = first_failing;
  options.timeout = timeout;
  auto size = at::tensor({static_cast<int64_t>(error.size())}, at::kLong);
  group.broadcast(size, options);
  if (group.rank() != first_failing) error.assign(static_cast<size_t>(size.item<int64_t>()), '\0');
  if (!error.empty()) {
    auto bytes = at::from_blob(error.data(), {static_cast<int64_t>(error.size())}, at::kByte);
    group.broadcast(bytes, options);
  }
  throw UsageError(error);
}

comm::Group checkpoint_group(const std::optional<comm::Group>& group, const std::string& path, const char* operation) {
  check_path(path, operation);
  return group_of(group, operation);
}

}  // namespace checkpoint

namespace {

// A model some of whose parameters are pieces of whole values (a global model's layers, wherever
// they sit) is saved whole (whole.h); any other is saved as the module holds it.
void save_checkpoint(const std::string& path, const torch::nn::Module& module, const torch::optim::Optimizer* optimizer,
                     const checkpoint::Stateful* loader, const SaveOptions& options) {
  const std::optional<checkpoint::StateDict> loader_state =
      loader != nullptr ? std::optional(loader->state_dict()) : std::nullopt;
  const checkpoint::StateDict* state = loader_state ? &*loader_state : nullptr;
  if (!checkpoint::pieces_of(module).empty()) {
    // Only read; the optimizer's state map is reached through the non-const accessor.
    checkpoint::save_whole(path, module, const_cast<torch::optim::Optimizer*>(optimizer), state, options);
    return;
  }
  comm::Group group = checkpoint::checkpoint_group(options.group, path, "shoal::save");
  checkpoint::save_payload(
      path, group, [&] { return checkpoint::serialize_contents(module, optimizer, state, options.extras); },
      options.timeout);
}

void load_checkpoint(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer* optimizer,
                     checkpoint::Stateful* loader, const LoadOptions& options) {
  if (!checkpoint::pieces_of(module).empty()) return checkpoint::load_whole(path, module, optimizer, loader, options);
  comm::Group group = checkpoint::checkpoint_group(options.group, path, "shoal::load");
  const std::string payload = checkpoint::read_payload(path, group, options.timeout);
  checkpoint::restore_contents(path, payload, module, optimizer, options.extras, loader);
}

}  // namespace

void save(const std::string& path, const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
          const checkpoint::Stateful& loader, const SaveOptions& options) {
  save_checkpoint(path, module, &optimizer, &loader, options);
}

void save(const std::string& path, const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
          const SaveOptions& options) {
  save_checkpoint(path, module, &optimizer, nullptr, options);
}

void save(const std::string& path, const torch::nn::Module& module, const SaveOptions& options) {
  save_checkpoint(path, module, nullptr, nullptr, options);
}

void load(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
          checkpoint::Stateful& loader, const LoadOptions& options) {
  load_checkpoint(path, module, &optimizer, &loader, options);
}

void load(const std::string& path, torch::nn::Module& module, torch::optim::Optimizer& optimizer,
          const LoadOptions& options) {
  load_checkpoint(path, module, &optimizer, nullptr, options);
}

void load(const std::string& path, torch::nn::Module& module, const LoadOptions& options) {
  load_checkpoint(path, module, nullptr, nullptr, options);
}

}  // namespace shoal

namespace shoal::checkpoint {

std::string encode_payload(const torch::nn::Module& module, const torch::optim::Optimizer* optimizer,
                           const Stateful* loader, const CheckpointExtras& extras) {
  if (loader == nullptr) return serialize_contents(module, optimizer, nullptr, extras);
  const StateDict state = loader->state_dict();
  return serialize_contents(module, optimizer, &state, extras);
}

void decode_payload(const std::string& what, std::string_view payload, torch::nn::Module& module,
                    torch::optim::Optimizer* optimizer, CheckpointExtras* extras, Stateful* loader) {
  restore_contents(what, payload, module, optimizer, extras, loader);
}

void write_file(const std::string& path, std::string_view payload) {
  const std::string header = encode_header(payload);
  write_file_atomically(path, {header, payload});
}

std::string read_file(const std::string& path) {
  const std::string file = read_whole_file(path);
  return std::string(open_container(path, file));
}

}  // namespace shoal::checkpoint
