// Global tensors against their oracle, the whole value on one process: every boxing pair on 1-D
// and 2-D placements keeps the global value, and its backward is the adjoint (the gradient's
// global value comes back unchanged); creation gives what torch gives after the same seed;
// pieces of uneven splits fit; bad layouts are UsageErrors naming the op and the layouts.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "harness.h"
#include "shoal/global/ops.h"
#include "shoal/global/tensor.h"
#include "shoal/shoal.h"

namespace {

namespace g = shoal::global;
using shoal::testing::run_workers;

std::vector<g::Sbp> kinds(int64_t ndim) {
  std::vector<g::Sbp> all = {g::broadcast(), g::partial_sum()};
  for (int64_t d = 0; d < ndim; ++d) all.push_back(g::split(d));
  return all;
}

// Every NdSbp for a placement of `axes` axes over a tensor of `ndim` dims.
std::vector<g::NdSbp> layouts(int axes, int64_t ndim) {
  std::vector<g::NdSbp> out;
  const auto one = kinds(ndim);
  if (axes == 1) {
    for (const auto& s : one) out.emplace_back(s);
    return out;
  }
  for (const auto& a : one) {
    for (const auto& b : one) out.push_back(g::NdSbp{a, b});
  }
  return out;
}

// The sum over the job's workers (the global value of a gradient's pieces of `full`).
torch::Tensor summed(const torch::Tensor& t) {
  torch::Tensor sum = t.clone();
  shoal::world().all_reduce(sum);
  return sum;
}

// x (whole, the same everywhere) -> from_full(from) -> to_global(to): the value stays, and the
// backward of a gradient whose global value is w gives back w.
void check_pair(const std::vector<int64_t>& shape, const g::Placement& a, const g::NdSbp& from,
                const g::Placement& b, const g::NdSbp& to) {
  torch::manual_seed(42);
  const torch::Tensor x = torch::randn(shape);
  const torch::Tensor w = torch::randn(shape);
  torch::Tensor whole = x.clone().requires_grad_();
  const g::GlobalTensor before = g::GlobalTensor::from_full(whole, a, from);
  const g::GlobalTensor after = before.to_global(b, to);
  const std::string what =
      from.describe() + " on " + a.describe() + " -> " + to.describe() + " on " + b.describe();
  ASSERT_EQ(after.shape(), shape) << what;
  bool unique = true;  // a partial_sum has many sets of pieces; the others one
  for (const auto& s : to.axes()) unique = unique && !s.is_partial_sum();
  if (after.is_local() && unique) {
    // This worker's piece is the one the oracle cuts.
    const auto piece = g::GlobalTensor::from_full(x, b, to).to_local();
    ASSERT_TRUE(after.to_local().allclose(piece, 1e-6, 1e-6)) << what;
  }
  ASSERT_TRUE(after.detach().full().allclose(x, 1e-6, 1e-6)) << what;
  after.backward(g::GlobalTensor::from_full(w, b, g::dual(to)));
  ASSERT_TRUE(whole.grad().defined()) << what;
  ASSERT_TRUE(summed(whole.grad()).allclose(w, 1e-5, 1e-5))
      << what << ": the backward is not the adjoint";
}

class Boxing : public ::testing::TestWithParam<int> {};

TEST_P(Boxing, EveryPairOnALine) {
  run_workers(GetParam(), [] {
    const auto all = g::Placement::all();
    for (const auto& shape :
         {std::vector<int64_t>{5, 7}, std::vector<int64_t>{4, 6}, std::vector<int64_t>{3},
          std::vector<int64_t>{2, 1}}) {  // a dim smaller than the workers
      for (const auto& from : layouts(1, static_cast<int64_t>(shape.size()))) {
        for (const auto& to : layouts(1, static_cast<int64_t>(shape.size())))
          check_pair(shape, all, from, all, to);
      }
    }
  });
}

TEST_P(Boxing, BetweenPlacements) {
  const int n = GetParam();
  run_workers(n, [n] {
    const auto all = g::Placement::all();
    std::vector<g::Placement> places = {all, g::Placement({0})};
    if (n > 1) places.push_back(g::Placement({n - 1}));
    if (n > 2) places.push_back(g::Placement({n - 1, 0}));
    if (n > 3) places.push_back(g::Placement({2, 3}));
    const std::vector<int64_t> shape = {5, 3};
    for (const auto& a : places) {
      for (const auto& b : places) {
        if (a == b) continue;
        for (const auto& from : layouts(1, 2)) {
          for (const auto& to : layouts(1, 2)) check_pair(shape, a, from, b, to);
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Boxing, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

TEST(Boxing2d, EveryPairOnA2x2Mesh) {
  run_workers(4, [] {
    const auto mesh = g::Placement::mesh({2, 2});
    for (const auto& shape : {std::vector<int64_t>{5, 7}, std::vector<int64_t>{4, 4}}) {
      for (const auto& from : layouts(2, 2)) {
        for (const auto& to : layouts(2, 2)) check_pair(shape, mesh, from, mesh, to);
      }
    }
    // Between the mesh and a line of the same workers, and two meshes of halves.
    for (const auto& from : layouts(2, 2)) {
      for (const auto& to : layouts(1, 2)) {
        check_pair({5, 7}, mesh, from, g::Placement::all(), to);
        check_pair({5, 7}, g::Placement::all(), to, mesh, from);
      }
    }
    const auto left = g::Placement::mesh({1, 2}, {0, 1});
    const auto right = g::Placement::mesh({1, 2}, {2, 3});
    for (const auto& s : layouts(2, 2)) check_pair({5, 7}, left, s, right, s);
  });
}

TEST(GlobalTensor, CreationGivesTheOneProcessValues) {
  run_workers(3, [] {
    const auto all = g::Placement::all();
    torch::manual_seed(7);
    const auto a = g::randn({5, 4}, all, g::split(0));
    const auto b = g::rand({5, 4}, all, g::partial_sum());
    const auto c = g::arange(7, all, g::split(0));
    torch::manual_seed(7);
    const auto ra = torch::randn({5, 4});
    const auto rb = torch::rand({5, 4});
    EXPECT_TRUE(a.full().equal(ra));
    EXPECT_TRUE(b.full().allclose(rb));
    EXPECT_TRUE(c.full().equal(torch::arange(7)));
    EXPECT_TRUE(g::full({2, 3}, 2.5, all, g::split(1)).full().equal(torch::full({2, 3}, 2.5)));
    EXPECT_TRUE(g::zeros({4}, all, g::broadcast()).full().equal(torch::zeros({4})));
    EXPECT_TRUE(g::ones({4}, all, g::split(0)).full().equal(torch::ones({4})));
    // Uneven: 5 rows over 3 workers are 2, 2, 1.
    EXPECT_EQ(a.to_local().size(0), std::vector<int64_t>({2, 2, 1})[shoal::rank()]);
  });
}

TEST(GlobalTensor, FromLocalFindsTheShapeOfUnevenPieces) {
  run_workers(3, [] {
    const auto all = g::Placement::all();
    const int64_t rows = std::vector<int64_t>({3, 3, 2})[shoal::rank()];
    const auto t =
        g::GlobalTensor::from_local(torch::full({rows, 2}, shoal::rank()), all, g::split(0));
    EXPECT_EQ(t.shape(), std::vector<int64_t>({8, 2}));
    const auto expected =
        torch::cat({torch::full({3, 2}, 0), torch::full({3, 2}, 1), torch::full({2, 2}, 2)});
    EXPECT_TRUE(t.full().to(torch::kFloat).equal(expected.to(torch::kFloat)));
    // A member that passes nothing: every worker raises, none is left waiting for it.
    try {
      g::GlobalTensor::from_local(shoal::rank() == 1 ? torch::Tensor() : torch::zeros({3, 2}), all,
                                  g::split(0));
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(), "from_local: worker 1, a member of [0, 1, 2], passed no tensor");
    }
    // Pieces that split_sizes would not cut: 2, 3, 3.
    const int64_t wrong = std::vector<int64_t>({2, 3, 3})[shoal::rank()];
    try {
      g::GlobalTensor::from_local(torch::zeros({wrong, 2}), all, g::split(0));
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "from_local: the pieces do not fit together as split(0) on [0, 1, 2]"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(GlobalTensor, BadLayoutsAreUsageErrors) {
  run_workers(2, [] {
    const auto all = g::Placement::all();
    try {
      g::randn({4, 5}, all, g::split(2));
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(
          e.what(),
          "randn: split(2) is out of range for a tensor of 2 dimensions (placement [0, 1], sbp "
          "split(2))");
    }
    try {
      g::zeros({4}, g::Placement({0, 2}), g::broadcast());
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_STREQ(e.what(),
                   "zeros: placement [0, 2] names worker 2, but the job has 2 workers (0 to 1)");
    }
    try {
      g::zeros({4}, g::Placement::mesh({2, 1}), g::broadcast());
      ADD_FAILURE() << "expected UsageError";
    } catch (const shoal::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("expected one Sbp per mesh axis"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(g::Placement({0, 0}), shoal::UsageError);
    EXPECT_THROW(g::Placement::mesh({3}), shoal::UsageError);
  });
}

// What shoal::world_size() raises before init(): the error every global entry point must raise.
std::string before_init_error() {
  try {
    shoal::world_size();
  } catch (const shoal::UsageError& e) {
    return e.what();
  }
  ADD_FAILURE() << "world_size() did not raise before init()";
  return "";
}

// Each call raises that same UsageError (type and message), naming no partial job of one.
void expect_before_init_errors(
    const std::vector<std::pair<std::string, std::function<void()>>>& calls) {
  const std::string expected = before_init_error();
  ASSERT_FALSE(expected.empty());
  for (const auto& [name, call] : calls) {
    try {
      call();
      ADD_FAILURE() << name << " ran without shoal::init(); expected UsageError: " << expected;
    } catch (const shoal::UsageError& e) {
      EXPECT_EQ(std::string(e.what()), expected) << name;
    }
  }
}

TEST(GlobalTensor, BeforeInitEveryEntryPointRaisesWhatWorldSizeRaises) {
  shoal::testing::WorkersOptions options;
  options.init = false;
  options.launcher = shoal::testing::Launcher::kNone;
  run_workers(
      1,
      [] {
        ASSERT_FALSE(shoal::is_initialized());
        // A placement of named workers is a value, like a torch::Device; using it needs the job.
        const g::Placement zero({0});
        const auto whole = torch::ones({2, 3});
        expect_before_init_errors({
            {"Placement::all", [] { g::Placement::all(); }},
            {"Placement::mesh", [] { g::Placement::mesh({1}); }},
            {"randn",
             [&] {
               g::randn({2, 3}, zero, g::split(0));
             }},
            {"rand",
             [&] {
               g::rand({2, 3}, zero, g::broadcast());
             }},
            {"zeros",
             [&] {
               g::zeros({2, 3}, zero, g::broadcast());
             }},
            {"ones",
             [&] {
               g::ones({2, 3}, zero, g::partial_sum());
             }},
            {"full",
             [&] {
               g::full({2, 3}, 1.5, zero, g::split(1));
             }},
            {"arange", [&] { g::arange(4, zero, g::split(0)); }},
            {"from_full", [&] { g::GlobalTensor::from_full(whole, zero, g::split(0)); }},
            {"from_local", [&] { g::GlobalTensor::from_local(whole, zero, g::broadcast()); }},
            {"from_local with a shape",
             [&] {
               g::GlobalTensor::from_local(whole, zero, g::broadcast(), {2, 3});
             }},
        });
      },
      options);
}

TEST(GlobalTensor, AfterShutdownTensorsRaiseWhatWorldSizeRaises) {
  run_workers(2, [] {
    const auto all = g::Placement::all();
    const auto x = g::randn({4, 4}, all, g::split(0)).requires_grad_();
    const auto w = g::randn({4, 4}, all, g::broadcast());
    shoal::shutdown();
    expect_before_init_errors({
        {"matmul", [&] { g::matmul(x, w); }},
        {"add", [&] { g::add(x, w); }},
        {"sum", [&] { g::sum(x); }},
        {"full()", [&] { x.full(); }},
        {"to_global", [&] { x.to_global(all, g::broadcast()); }},
        {"backward", [&] { g::sum(x).backward(); }},
    });
  });
}

TEST(GlobalTensor, DescribeSaysShapeDtypePlacementAndSbp) {
  run_workers(2, [] {
    const auto all = g::Placement::all();
    EXPECT_EQ(g::randn({4, 5}, all, g::split(0)).describe(),
              "GlobalTensor of shape [4, 5], float, on [0, 1] as split(0)");
    EXPECT_EQ(g::arange(6, all, g::broadcast()).describe(),
              "GlobalTensor of shape [6], long, on [0, 1] as broadcast");
    // Worker 0 holds no piece of a tensor on [1] and describes the same global tensor.
    EXPECT_EQ(g::zeros({3}, g::Placement({1}), g::partial_sum(), torch::kDouble).describe(),
              "GlobalTensor of shape [3], double, on [1] as partial_sum");
    EXPECT_EQ(g::ones({4, 2}, g::Placement::mesh({2, 1}), g::NdSbp{g::split(0), g::broadcast()})
                  .describe(),
              "GlobalTensor of shape [4, 2], float, on the 2x1 mesh [0, 1] as (split(0), "
              "broadcast)");
    EXPECT_EQ(g::GlobalTensor().describe(), "an empty GlobalTensor");
    // The placement alone keeps its own form.
    EXPECT_EQ(g::Placement::mesh({2, 1}).describe(), "[0, 1] as 2x1");
  });
}

}  // namespace
