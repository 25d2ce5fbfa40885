#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"

int main(int argc, char** argv) {
  // Returns here in the test process and, with its own arguments, in every worker it starts.
  std::vector<std::string> args = shoal::testing::start_worker_server(argc, argv);
  std::vector<char*> pointers;
  for (auto& arg : args) pointers.push_back(arg.data());
  pointers.push_back(nullptr);
  int count = static_cast<int>(args.size());
  ::testing::InitGoogleTest(&count, pointers.data());
  return RUN_ALL_TESTS();
}
