// A pipeline-parallel MLP: the model's layers cut into one stage per worker (two with
// --schedule interleaved), each batch cut into micro-batches that the stages work on at the same
// time. On one process all stages run in it; --no-pipeline trains the plain model instead, the
// reference the pipeline's losses must equal.
//   build/bin/shoal run -n 2 build/examples/pipeline_mlp --schedule 1f1b --micro-batches 4
#include <iomanip>
#include <iostream>

#include <shoal/shoal.h>

#include "cli.h"

namespace pp = shoal::pipeline;

int main(int argc, char** argv) {
  CLI::App app{
      "A pipeline-parallel MLP on a synthetic regression task; run under `shoal run -n N`.",
      "pipeline_mlp"};
  std::string schedule = "1f1b";
  int micro_batches = 4;
  int steps = 20;
  int batch = 32;
  int width = 64;
  bool plain = false;
  app.add_option("--schedule", schedule, "gpipe, 1f1b, interleaved or zb")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb"}));
  app.add_option("--micro-batches", micro_batches, "micro-batches per batch")
      ->check(examples::positive());
  app.add_option("--steps", steps, "training steps")->check(examples::positive());
  app.add_option("--batch", batch, "rows per batch")->check(examples::positive());
  app.add_option("--width", width, "the hidden layers' width")->check(examples::positive());
  app.add_flag("--no-pipeline", plain, "train the plain model on this process (the reference)");
  if (const int code = examples::parse(app, argc, argv); code >= 0) return code;
  shoal::init();

  // The same whole model on every worker; the pipeline keeps this worker's stages.
  torch::manual_seed(0);
  // Four equal hidden layers between a small input and output layer, so that 2 or 4 stages
  // balanced by parameter count cost about the same.
  torch::nn::Sequential net(torch::nn::Linear(16, width), torch::nn::Tanh());
  for (int layer = 0; layer < 4; ++layer) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::Tanh());
  }
  net->push_back(torch::nn::Linear(width, 1));
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::mse_loss(out, y);
  };
  // A fixed target function; every worker draws the same batches.
  torch::manual_seed(1);
  const auto teacher = torch::randn({16, 1});

  std::unique_ptr<pp::Pipeline> pipe;
  std::vector<torch::Tensor> parameters = net->parameters();
  if (!plain) {
    pp::PipelineOptions options;
    options.schedule = shoal::pipeline::parse_schedule_kind(schedule);
    options.micro_batches = micro_batches;
    pipe = std::make_unique<pp::Pipeline>(net, options);
    parameters = pipe->parameters();
    if (shoal::is_main()) {
      std::cout << pipe->schedule().name << ", " << pipe->stages() << " stages on "
                << shoal::world_size() << " workers, " << micro_batches << " micro-batches"
                << std::endl;
    }
  }
  torch::optim::SGD optimizer(parameters, 0.05);
  double loss = 0;
  for (int step = 0; step < steps; ++step) {
    const auto x = torch::randn({batch, 16});
    const auto y = torch::sin(x.matmul(teacher));
    optimizer.zero_grad();
    if (plain) {
      auto value = loss_fn(net->forward(x), y);
      value.backward();
      loss = value.item<double>();
    } else {
      loss = pipe->step(x, y, loss_fn).item<double>();
    }
    optimizer.step();
    if (shoal::is_main()) {
      std::cout << "step " << step << " loss " << std::setprecision(8) << loss << std::endl;
    }
  }
  if (shoal::is_main()) std::cout << "final loss " << std::setprecision(8) << loss << std::endl;
}
