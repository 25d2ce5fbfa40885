// Gloo's path (Note [Data paths]): every operation of a group of several members, over c10d's
// ProcessGroupGloo.
#include <numeric>

#include "data_path.h"

namespace shoal::comm {
namespace {

class GlooPath final : public DataPath {
 public:
  explicit GlooPath(c10::intrusive_ptr<c10d::ProcessGroupGloo> backend)
      : backend_(std::move(backend)) {}

  bool all_reduce(Work::State& work, const at::Tensor& buffer, ReduceOp op) override {
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = to_backend(op);
    work.backend_work = backend_->allreduce(tensors, options);
    return false;  // Gloo has no average: Group divides the sum
  }

  void broadcast(Work::State& work, const at::Tensor& buffer, int root) override {
    std::vector<at::Tensor> tensors{buffer};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    work.backend_work = backend_->broadcast(tensors, options);
  }

  void all_gather(Work::State& work, const at::Tensor& tensor, const Sizes& sizes,
                  int rank) override {
    // Gloo's all-gather needs equal parts: pad each to the largest, cut on completion.
    const int n = static_cast<int>(sizes.size());
    const int64_t rows = *std::max_element(sizes.begin(), sizes.end());
    at::Tensor input = tensor;
    if (input.size(0) != rows) {
      at::Tensor padded = at::zeros(shape_with_rows(input, rows), input.options());
      padded.narrow(0, 0, input.size(0)).copy_(input);
      input = padded;
    }
    std::vector<at::Tensor> parts;
    if (rows > 0 && input.numel() > 0) {
      std::vector<std::vector<at::Tensor>> outputs(1);
      for (int i = 0; i < n; ++i) outputs[0].push_back(at::empty_like(input));
      std::vector<at::Tensor> inputs{input};
      work.backend_work = backend_->allgather(outputs, inputs);
      parts = outputs[0];
    } else {
      for (int i = 0; i < n; ++i) parts.push_back(input);  // nothing to send: all empty
    }
    work.finish = [parts, sizes](Work::State& done) {
      std::vector<at::Tensor> pieces;
      for (size_t i = 0; i < parts.size(); ++i) pieces.push_back(parts[i].narrow(0, 0, sizes[i]));
      done.result = at::cat(pieces, 0);
    };
  }

  void all_to_all(Work::State& work, const at::Tensor& input, const at::Tensor& output,
                  const Sizes& send, const Sizes& recv) override {
    // Every member takes part even when it sends and receives nothing: Gloo numbers its
    // collectives, and one member skipping would pair the others' next call with this one.
    // c10d moves the sizes away, so it gets copies.
    at::Tensor in = input, out = output;
    Sizes send_sizes = send, recv_sizes = recv;
    work.backend_work = backend_->alltoall_base(out, in, recv_sizes, send_sizes);
    work.finish = [output](Work::State& done) { done.result = output; };
  }

  void reduce_scatter(Work::State& work, const at::Tensor& input, const Sizes& sizes, int rank,
                      ReduceOp op) override {
    // An all-to-all moves the same bytes as a ring reduce-scatter ((n-1)/n of the input per
    // worker) and handles uneven parts and every op; the reduction then runs locally.
    const int n = static_cast<int>(sizes.size());
    const int64_t mine = sizes[rank];
    at::Tensor output = at::empty(shape_with_rows(input, mine * n), input.options());
    all_to_all(work, input, output, sizes, Sizes(n, mine));
    work.finish = [output, n, mine, op](Work::State& done) {
      auto shape = output.sizes().vec();
      shape[0] = mine;
      shape.insert(shape.begin(), n);
      done.result = reduce_rows(output.view(shape), op);
    };
  }

  void send(Work::State& work, const at::Tensor& buffer, int dst, int tag) override {
    std::vector<at::Tensor> tensors{buffer};
    work.backend_work = backend_->send(tensors, dst, tag);
  }

  void recv(Work::State& work, const at::Tensor& buffer, int src, int tag) override {
    std::vector<at::Tensor> tensors{buffer};
    work.backend_work = backend_->recv(tensors, src, tag);
  }

  void barrier(Work::State& work) override { work.backend_work = backend_->barrier(); }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupGloo> backend_;
};

}  // namespace

std::unique_ptr<DataPath> gloo_path(c10::intrusive_ptr<c10d::ProcessGroupGloo> backend) {
  return std::make_unique<GlooPath>(std::move(backend));
}

}  // namespace shoal::comm
