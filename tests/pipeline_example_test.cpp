// examples/pipeline_mlp.cpp under the real `shoal run -n 2`, in each schedule: its losses step by
// step equal the plain model's trained on one process (relative 1e-4, as the GPT's plans).
#include <filesystem>
#include <regex>

#include <gtest/gtest.h>

#include "shoal_run.h"
#include "test_paths.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string example() {
  return fs::path(test_programs_dir()).parent_path() / "examples" / "pipeline_mlp";
}

std::vector<double> losses(const RunResult& result) {
  std::vector<double> found;
  static const std::regex line(R"(step \d+ loss ([-0-9.e+na]+))");
  for (std::sregex_iterator it(result.out.begin(), result.out.end(), line), end; it != end; ++it)
    found.push_back(std::stod((*it)[1]));
  return found;
}

TEST(PipelineExample, EveryScheduleTrainsAsOneProcess) {
  const std::vector<std::string> common = {"--steps", "8", "--batch", "20"};
  auto args = [&](std::vector<std::string> head) {
    head.insert(head.end(), common.begin(), common.end());
    return head;
  };
  const auto plain = run_shoal(args({"-n", "1", example(), "--no-pipeline"}), 60s);
  ASSERT_EQ(plain.exit_code, 0) << plain.out << plain.err;
  const auto expected = losses(plain);
  ASSERT_EQ(expected.size(), 8u) << plain.out;
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved", "zb"}) {
    // 20 rows in 3 micro-batches: 7, 7 and 6.
    const auto result = run_shoal(
        args({"-n", "2", example(), "--schedule", schedule, "--micro-batches", "3"}), 60s);
    ASSERT_EQ(result.exit_code, 0) << schedule << ":\n" << result.out << result.err;
    EXPECT_NE(result.out.find(schedule == "interleaved" ? "4 stages on 2 workers"
                                                        : "2 stages on 2 workers"),
              std::string::npos)
        << result.out;
    const auto got = losses(result);
    ASSERT_EQ(got.size(), expected.size()) << schedule << ":\n" << result.out;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], expected[i], 1e-4 * std::abs(expected[i])) << schedule << " step " << i;
  }
}

TEST(PipelineExample, BadScheduleIsAOneLineErrorWithExitCode2) {
  const auto result = run_shoal({"-n", "1", example(), "--schedule", "pipedream"}, 60s);
  EXPECT_EQ(result.exit_code, 2) << result.out << result.err;
  EXPECT_NE(
      result.err.find("pipeline_mlp: --schedule: pipedream not in {gpipe,1f1b,interleaved,zb}"),
      std::string::npos)
      << result.err;
}

}  // namespace
}  // namespace shoal::testing
