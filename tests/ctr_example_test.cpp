// examples/ctr.cpp, DeepFM on the synthetic CTR set, on one process: it learns to within 10% of
// the Bayes AUC from 200,000 samples, and prints the held-out numbers beside the optimum's.
// (The full run, 3 million samples, reaches 0.985 of it: docs/data.md.)
#include <filesystem>
#include <regex>

#include <gtest/gtest.h>

#include "shoal_run.h"
#include "test_paths.h"

namespace shoal::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

TEST(CtrExample, LearnsTowardsTheBayesOptimum) {
  const std::string example =
      fs::path(SHOAL_TEST_PROGRAMS_DIR).parent_path() / "examples" / "ctr";
  const auto run = run_shoal(
      {"-n", "1", example, "--samples", "200000", "--test-samples", "20000", "--reports", "2"},
      120s);
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  std::smatch m;
  static const std::regex last(
      R"(test logloss ([0-9.]+) \(Bayes ([0-9.]+)\)  AUC ([0-9.]+) \(Bayes ([0-9.]+), ratio ([0-9.]+)\))");
  ASSERT_TRUE(std::regex_search(run.out, m, last)) << run.out;
  const double logloss = std::stod(m[1]), bayes_logloss = std::stod(m[2]);
  const double auc = std::stod(m[3]), bayes_auc = std::stod(m[4]);
  EXPECT_GT(logloss, bayes_logloss);  // nothing beats the optimum on held-out data
  EXPECT_LT(auc, bayes_auc);
  EXPECT_GT(auc / bayes_auc, 0.9) << run.out;
  EXPECT_NEAR(std::stod(m[5]), auc / bayes_auc, 1e-3);
  // Two progress lines, then the epoch's.
  static const std::regex progress(R"(epoch 1 step \d+/196 )");
  EXPECT_EQ(std::distance(std::sregex_iterator(run.out.begin(), run.out.end(), progress),
                          std::sregex_iterator()),
            2)
      << run.out;
}

}  // namespace
}  // namespace shoal::testing
