// The shared-memory path (Note [Data paths]): every member on this host, through the host's
// segment (docs/comm.md, "Shared memory among co-located workers").
#include <numeric>

#include "data_path.h"

namespace shoal::comm {

void ShmPath::submit(Work::State& work, std::function<void(shm::LocalGroup&, Duration)> operation) {
  // Work::wait runs it on the caller when no membership of the group's own must be asked between
  // slices (wait_shared_memory); only then may the lane be left asleep.
  const bool wake = !take_waited_at_once() || state_.options.lost_check;
  work.shm_task = state_.shm->submit(
      [operation = std::move(operation), deadline = work.deadline](shm::LocalGroup& group) {
        operation(group, deadline.remaining());
      },
      wake);
}

bool ShmPath::all_reduce(Work::State& work, const at::Tensor& buffer, ReduceOp op) {
  const auto dtype = *shm_dtype(buffer.scalar_type());
  submit(work, [buffer, dtype, op](shm::LocalGroup& group, Duration timeout) {
    group.all_reduce(buffer.data_ptr(), buffer.numel(), dtype, to_shm(op), timeout);
  });
  return true;  // the segment's reduction divides an average in its own pass
}

void ShmPath::broadcast(Work::State& work, const at::Tensor& buffer, int root) {
  const auto dtype = *shm_dtype(buffer.scalar_type());
  submit(work, [buffer, dtype, root](shm::LocalGroup& group, Duration timeout) {
    group.broadcast(buffer.data_ptr(), buffer.numel(), dtype, root, timeout);
  });
}

void ShmPath::all_gather(Work::State& work, const at::Tensor& input, const Sizes& sizes,
                         int /*rank*/) {
  // Parts of any size, straight into the output: no padding.
  at::Tensor output = at::empty(
      shape_with_rows(input, std::accumulate(sizes.begin(), sizes.end(), int64_t{0})),
      input.options());
  const auto dtype = *shm_dtype(input.scalar_type());
  submit(work, [input, output, counts = element_counts(input, sizes), dtype](
                   shm::LocalGroup& group, Duration timeout) {
    group.all_gather(input.data_ptr(), output.data_ptr(), counts, dtype, timeout);
  });
  work.finish = [output](Work::State& done) { done.result = output; };
}

void ShmPath::all_to_all(Work::State& work, const at::Tensor& input, const at::Tensor& output,
                         const Sizes& send, const Sizes& recv) {
  const auto dtype = *shm_dtype(input.scalar_type());
  submit(work, [input, output, dtype, send_counts = element_counts(input, send),
                recv_counts = element_counts(input, recv)](shm::LocalGroup& group,
                                                           Duration timeout) {
    group.all_to_all(input.data_ptr(), send_counts, output.data_ptr(), recv_counts, dtype,
                     timeout);
  });
  work.finish = [output](Work::State& done) { done.result = output; };
}

void ShmPath::reduce_scatter(Work::State& work, const at::Tensor& input, const Sizes& sizes,
                             int rank, ReduceOp op) {
  // Reduced where it lies: each member sums its own part of every member's input.
  at::Tensor output = at::empty(shape_with_rows(input, sizes[rank]), input.options());
  const auto dtype = *shm_dtype(input.scalar_type());
  submit(work, [input, output, dtype, op, counts = element_counts(input, sizes)](
                   shm::LocalGroup& group, Duration timeout) {
    group.reduce_scatter(input.data_ptr(), output.data_ptr(), counts, dtype, to_shm(op), timeout);
  });
  work.finish = [output](Work::State& done) { done.result = output; };
}

void ShmPath::send(Work::State& work, const at::Tensor& buffer, int dst, int tag) {
  work.shm_task = state_.shm->send(dst, static_cast<uint32_t>(tag), buffer.data_ptr(),
                                   buffer.nbytes(), work.deadline,
                                   std::make_shared<at::Tensor>(buffer));
}

void ShmPath::recv(Work::State& work, const at::Tensor& buffer, int src, int tag) {
  work.shm_task = state_.shm->recv(src, static_cast<uint32_t>(tag), buffer.data_ptr(),
                                   buffer.nbytes(), work.deadline,
                                   std::make_shared<at::Tensor>(buffer));
}

void ShmPath::barrier(Work::State& work) {
  submit(work, [](shm::LocalGroup& group, Duration timeout) { group.barrier(timeout); });
}

}  // namespace shoal::comm
