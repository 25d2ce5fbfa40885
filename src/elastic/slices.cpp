// An elastic job's sharded model: the commit's copy on the next worker, and the re-cut for a new
// world (slices.h).

#include "slices.h"

#include <algorithm>
#include <bitset>
#include <cstring>

#include <torch/csrc/autograd/variable.h>

#include "shoal/checkpoint/param_state.h"
#include "shoal/core/error.h"

namespace shoal::elastic {

// Note [Slices in an elastic job]
// At a ZeRO stage each worker holds one slice of every parameter, and its optimizer's state for
// that slice only (src/dp/shards.h): a worker that dies takes its part of the model with it, and
// a world of another size needs every slice cut again. So:
// - At every commit (after the snapshot, before the vote) each member sends its slices and their
//   optimizer state to the next member (rank + 1, around the ring) and keeps the previous one's,
//   tagged with the commit's version and lineage; one send and one receive of 1/N of the model's
//   state (16 bytes a parameter with Adam over N workers: 12/N here, the gradients not being part
//   of a commit). Stages 1-3 alike.
// - When a round forms, sync() gathers what each member holds (SlicedCommits::holding) and plans
//   the newest commit's parts: each from a member whose own slices are that commit's (unchanged
//   since, Note [Commits without copies]), else from the member that keeps its copy. The slices
//   are cut for the new world (the same tensors, which the optimizer holds, with new lengths) and
//   each parameter's parts travel in one all-to-all, each element once, from its holder to its
//   new owner, with its optimizer state; then every member copies its slices to the next again.
//   A newcomer holds nothing and receives its part; a worker that left with SIGTERM left its copy
//   on the next one; a world that only grew takes every part from its own holder.
// - A part is lost when its worker and the one holding its copy are both gone, or when its worker
//   died between its optimizer's step and the end of the commit's copy (its new slice was never
//   sent): the others' slices are at the new step, its copy at the one before. The job then takes
//   the durable commit (every member loads its part of the file), or stops with an error naming
//   the worker, when it keeps none (docs/memory.md, "Elastic jobs").
// - In the job's first round no member holds the job's values: each built the model as its
//   program does, and every slice is cut from the first member's whole parameters (a DataParallel
//   in an elastic job keeps its parameters whole until then, at stage 3 too).
// A DataParallel of an elastic job takes no values of its own: its forward refuses to run until
// elastic::State has given its slices theirs (dp::Slicing).

namespace {

constexpr int kHeaderTag = 0x5a11ce1;
constexpr int kRowsTag = 0x5a11ce2;
// A commit's copy is packed and sent about this many bytes of whole parameters per member at once.
constexpr int64_t kChunkBytes = int64_t{4} << 20;

// The columns of a parameter's part: its values, and each field its header row's mask names.
int64_t width_of(int64_t mask) {
  return 1 + static_cast<int64_t>(std::bitset<64>(static_cast<uint64_t>(mask)).count());
}

// The elements of the old cut's `part` that fall in the new cut's `member` (from >= to: none).
struct Overlap {
  int64_t from, to;
};
Overlap overlap(const comm::Sizes& old_starts, int part, const comm::Sizes& new_starts,
                int member) {
  return {std::max(old_starts[part], new_starts[member]),
          std::min(old_starts[part + 1], new_starts[member + 1])};
}

}  // namespace

SlicedCommits::SlicedCommits(std::shared_ptr<dp::Slicing> slicing,
                             torch::optim::Optimizer& optimizer)
    : slicing_(std::move(slicing)), optimizer_(optimizer) {
  try {
    fields_ = checkpoint::state_fields(optimizer);
  } catch (const UsageError& e) {
    throw UsageError(std::string("elastic::State of a DataParallel at a ZeRO stage: ") + e.what());
  }
  std::vector<const void*> held;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) held.push_back(p.unsafeGetTensorImpl());
  }
  for (const auto& slice : slicing_->slices()) {
    if (std::find(held.begin(), held.end(), slice.unsafeGetTensorImpl()) == held.end()) {
      throw UsageError(
          "elastic::State: the optimizer does not hold the slices of the DataParallel at a ZeRO "
          "stage; expected it built on the DataParallel's parameters()");
    }
  }
}

std::vector<int64_t> SlicedCommits::holding() const {
  return {slicing_->cut_size(), slicing_->cut_rank(), copy_.size,
          copy_.rank,           copy_.version,        static_cast<int64_t>(copy_.lineage)};
}

void SlicedCommits::header_row(size_t k, int64_t* row) const {
  row[0] = 0;
  row[1] = -1;
  row[2] = 0;
  const auto state = checkpoint::param_state(optimizer_, slicing_->slices()[k]);
  if (!state) return;
  row[0] = 1;
  row[1] = state->step.value_or(-1);
  for (size_t f = 0; f < fields_.size(); ++f) {
    auto found = state->fields.find(fields_[f]);
    if (found != state->fields.end() && found->second.defined()) row[2] |= int64_t{1} << f;
  }
}

std::vector<at::Tensor> SlicedCommits::own_columns(size_t k) const {
  const at::Tensor& slice = slicing_->slices()[k];
  std::vector<at::Tensor> columns{slice.detach()};
  if (const auto state = checkpoint::param_state(optimizer_, slice)) {
    for (const auto& field : fields_) {
      auto found = state->fields.find(field);
      if (found == state->fields.end() || !found->second.defined()) continue;
      columns.push_back(found->second.detach().reshape(-1).to(slice.scalar_type()).contiguous());
    }
  }
  return columns;
}

void SlicedCommits::copy_to_next(comm::Group& group, int64_t version, uint64_t lineage) {
  const int n = group.size();
  copy_.version = -1;  // what arrives replaces it
  if (n == 1 || slicing_->cut_size() != n) return;
  const auto& slices = slicing_->slices();
  const auto& params = slicing_->parameters();
  const auto count = static_cast<int64_t>(slices.size());
  at::NoGradGuard no_grad;
  auto header = at::empty({count, 3}, at::kLong);
  for (int64_t k = 0; k < count; ++k)
    header_row(static_cast<size_t>(k), header.data_ptr<int64_t>() + 3 * k);
  const int next = (group.rank() + 1) % n, previous = (group.rank() + n - 1) % n;
  auto theirs = at::empty({count, 3}, at::kLong);
  auto sent = group.send_async(header, next, {kHeaderTag});
  group.recv_async(theirs, previous, {kHeaderTag}).wait();
  sent.wait();
  // The previous member's part of each parameter, as its header says.
  std::vector<int64_t> received(slices.size());
  int64_t expected = 0;
  copy_.columns.clear();
  std::vector<std::pair<int64_t, int64_t>> shapes;
  const int64_t* masks = theirs.data_ptr<int64_t>() + 2;  // column 2 of each row
  for (size_t k = 0; k < slices.size(); ++k) {
    const auto starts = comm::split_starts(params[k].numel(), n);
    const int64_t length = starts[previous + 1] - starts[previous];
    const int64_t width = width_of(masks[3 * k]);
    shapes.emplace_back(length, width);
    received[k] = length * width * static_cast<int64_t>(slices[k].element_size());
    expected += received[k];
  }
  if (!copy_.bytes.defined() || copy_.bytes.numel() != expected)
    copy_.bytes = at::empty({expected}, at::kByte);
  // In chunks of consecutive parameters, cut alike on both sides (by the whole parameters' sizes),
  // so that packing holds one chunk at a time.
  int64_t at_byte = 0;
  for (size_t first = 0; first < slices.size();) {
    size_t last = first;
    int64_t whole = 0, incoming = 0;
    while (last < slices.size() && (last == first || whole < kChunkBytes * n)) {
      whole += params[last].numel() * static_cast<int64_t>(params[last].element_size());
      incoming += received[last];
      ++last;
    }
    // Each parameter's columns one after the other ([columns, length]): one memcpy each.
    std::vector<at::Tensor> columns;
    int64_t outgoing = 0;
    for (size_t k = first; k < last; ++k) {
      for (auto& column : own_columns(k)) {
        outgoing += static_cast<int64_t>(column.nbytes());
        columns.push_back(std::move(column));
      }
    }
    auto packed = at::empty({outgoing}, at::kByte);
    int64_t offset = 0;
    for (const auto& column : columns) {
      if (column.nbytes() > 0)
        std::memcpy(packed.data_ptr<uint8_t>() + offset, column.data_ptr(), column.nbytes());
      offset += static_cast<int64_t>(column.nbytes());
    }
    columns.clear();
    at::Tensor into = copy_.bytes.narrow(0, at_byte, incoming);
    sent = group.send_async(packed, next, {kRowsTag});
    group.recv_async(into, previous, {kRowsTag}).wait();
    sent.wait();
    at_byte += incoming;
    first = last;
  }
  int64_t offset = 0;
  for (size_t k = 0; k < slices.size(); ++k) {
    const auto [length, width] = shapes[k];
    copy_.columns.push_back(copy_.bytes.narrow(0, offset, received[k])
                                .view(slices[k].scalar_type())
                                .view({width, length}));
    offset += received[k];
  }
  copy_.header = theirs;
  copy_.size = n;
  copy_.rank = previous;
  copy_.lineage = lineage;
  copy_.version = version;
}

std::optional<SlicedCommits::Plan> SlicedCommits::plan(const at::Tensor& rows, int64_t version,
                                                       int64_t lineage, std::string* missing) {
  const auto r = rows.accessor<int64_t, 2>();
  const auto members = static_cast<int>(rows.size(0));
  Plan plan;
  auto own = [&](int m) {
    return r[m][kVersion] == version && r[m][kLineage] == lineage && r[m][kChanged] == 0 &&
           r[m][kCutSize] > 0;
  };
  auto copied = [&](int m) {
    return r[m][kCopyVersion] == version && r[m][kCopyLineage] == lineage && r[m][kCopySize] > 0;
  };
  for (int m = 0; m < members && plan.size == 0; ++m) {
    if (own(m)) plan.size = static_cast<int>(r[m][kCutSize]);
  }
  for (int m = 0; m < members && plan.size == 0; ++m) {
    if (copied(m)) plan.size = static_cast<int>(r[m][kCopySize]);
  }
  if (plan.size == 0) {
    *missing = "every part";
    return std::nullopt;
  }
  plan.holder.assign(plan.size, -1);
  plan.copy.assign(plan.size, false);
  for (int m = 0; m < members; ++m) {
    if (own(m) && r[m][kCutSize] == plan.size && plan.holder[r[m][kCutRank]] < 0)
      plan.holder[r[m][kCutRank]] = m;
  }
  for (int m = 0; m < members; ++m) {
    const int64_t part = r[m][kCopyRank];
    if (copied(m) && r[m][kCopySize] == plan.size && plan.holder[part] < 0) {
      plan.holder[part] = m;
      plan.copy[part] = true;
    }
  }
  missing->clear();
  for (int part = 0; part < plan.size; ++part) {
    if (plan.holder[part] < 0) *missing += (missing->empty() ? "" : ", ") + std::to_string(part);
  }
  if (!missing->empty()) return std::nullopt;
  return plan;
}

bool SlicedCommits::any_holds_values(const at::Tensor& rows) {
  return rows.select(1, kCutSize).gt(0).any().item<bool>();
}

void SlicedCommits::recut(comm::Group& group, const Plan& plan) {
  at::NoGradGuard no_grad;
  const int me = group.rank(), n = group.size();
  const auto& params = slicing_->parameters();
  const auto& slices = slicing_->slices();
  const auto count = static_cast<int64_t>(params.size());
  // The header of part 0's holder stands for every part (all members step every slice alike).
  auto header = at::zeros({count, 3}, at::kLong);
  if (plan.holder[0] == me) {
    if (plan.copy[0]) {
      header.copy_(copy_.header);
    } else {
      for (int64_t k = 0; k < count; ++k)
        header_row(static_cast<size_t>(k), header.data_ptr<int64_t>() + 3 * k);
    }
  }
  group.broadcast(header, {plan.holder[0]});
  const auto rows_of = header.accessor<int64_t, 2>();
  std::vector<int> mine;  // the parts this member holds
  bool own_part = false;  // one of them is its own slices'
  for (int part = 0; part < plan.size; ++part) {
    if (plan.holder[part] != me) continue;
    mine.push_back(part);
    own_part = own_part || !plan.copy[part];
  }
  // What each member sends to each: the rows of its parts that fall in the receiver's new range.
  struct Outgoing {
    at::Tensor rows;
    comm::Sizes send, recv;
  };
  std::vector<Outgoing> outgoing(params.size());
  for (size_t k = 0; k < params.size(); ++k) {
    const auto old_starts = comm::split_starts(params[k].numel(), plan.size);
    const auto new_starts = comm::split_starts(params[k].numel(), n);
    const int64_t width = width_of(rows_of[static_cast<int64_t>(k)][2]);
    std::vector<at::Tensor> pieces;
    Outgoing& out = outgoing[k];
    const at::Tensor own = own_part ? at::stack(own_columns(k), 1) : at::Tensor();
    for (int q = 0; q < n; ++q) {
      int64_t sent = 0;
      for (int part : mine) {
        const auto [from, to] = overlap(old_starts, part, new_starts, q);
        if (from >= to) continue;
        const at::Tensor rows = plan.copy[part] ? copy_.columns[k].t() : own;
        SHOAL_CHECK(rows.size(1) == width)
            << "parameter " << k << ": " << rows.size(1) << " columns, expected " << width;
        pieces.push_back(rows.narrow(0, from - old_starts[part], to - from));
        sent += to - from;
      }
      out.send.push_back(sent);
    }
    out.recv.assign(static_cast<size_t>(n), 0);
    for (int part = 0; part < plan.size; ++part) {
      const auto [from, to] = overlap(old_starts, part, new_starts, me);
      if (from < to) out.recv[static_cast<size_t>(plan.holder[part])] += to - from;
    }
    out.rows = pieces.empty() ? at::empty({0, width}, slices[k].options().requires_grad(false))
                              : at::cat(pieces, 0);
  }
  slicing_->recut();
  for (size_t k = 0; k < params.size(); ++k) {
    Outgoing& out = outgoing[k];
    comm::AllToAllOptions options;
    options.send_sizes = out.send;
    options.recv_sizes = out.recv;
    const at::Tensor got = group.all_to_all(out.rows, options);
    out.rows = at::Tensor();
    // Placed by where each piece lies in the parameter: senders in member order, each sending
    // its parts in order.
    const auto old_starts = comm::split_starts(params[k].numel(), plan.size);
    const auto new_starts = comm::split_starts(params[k].numel(), n);
    auto placed = at::empty_like(got);
    int64_t at_row = 0;
    for (int s = 0; s < n; ++s) {
      for (int part = 0; part < plan.size; ++part) {
        if (plan.holder[part] != s) continue;
        const auto [from, to] = overlap(old_starts, part, new_starts, me);
        if (from >= to) continue;
        placed.narrow(0, from - new_starts[me], to - from).copy_(got.narrow(0, at_row, to - from));
        at_row += to - from;
      }
    }
    const at::Tensor& slice = slices[k];
    slice.detach().copy_(placed.select(1, 0));
    const auto row = rows_of[static_cast<int64_t>(k)];
    if (row[0] == 0) {
      optimizer_.state().erase(c10::guts::to_string(slice.unsafeGetTensorImpl()));
      continue;
    }
    checkpoint::ParamState state;
    if (row[1] >= 0) state.step = row[1];
    int64_t column = 1;
    for (size_t f = 0; f < fields_.size(); ++f) {
      if ((row[2] & (int64_t{1} << f)) == 0) continue;
      state.fields[fields_[f]] = placed.select(1, column++).clone();
    }
    checkpoint::set_param_state(optimizer_, slice, state);
  }
  slicing_->filled();
}

void SlicedCommits::recut_from(comm::Group& group, int source) {
  at::NoGradGuard no_grad;
  slicing_->recut();
  const auto& params = slicing_->parameters();
  const auto& slices = slicing_->slices();
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor whole = params[k].detach();
    group.broadcast(whole, {source});
    const auto starts = comm::split_starts(whole.numel(), group.size());
    const at::Tensor part = whole.view(-1).narrow(0, starts[group.rank()],
                                                  starts[group.rank() + 1] - starts[group.rank()]);
    if (part.data_ptr() != slices[k].data_ptr()) slices[k].detach().copy_(part);
    optimizer_.state().erase(c10::guts::to_string(slices[k].unsafeGetTensorImpl()));
  }
  slicing_->filled();
}

}  // namespace shoal::elastic
