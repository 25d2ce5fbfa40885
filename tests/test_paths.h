// Where the tests find the programs they start and the files they read: the build's `shoal`, the
// test programs (tests/programs), the examples and the source tree.
//
// Note [Test paths in one source]: the paths are absolute and differ from clone to clone of the
// tree, so they are compiled into one source (test_paths.cpp, which alone includes the header
// tests/CMakeLists.txt generates) rather than into every test's text; otherwise no test source
// compiled in one clone could be served by ccache to another (Note [ccache across clones] in
// CMakeLists.txt). Each is made on first use, so a test may read them in a static initializer.
#pragma once

#include <string>

namespace shoal::testing {

// The `shoal` command of this build.
const std::string& shoal_bin();
// The build directory of the tests, holding the test programs (fault_worker, ps_worker, ...).
const std::string& test_programs_dir();
// The source directory of the tests (tests/), holding fixtures.
const std::string& tests_source_dir();
// The source directory of the examples (examples/).
const std::string& examples_source_dir();

// Defined only where the examples are built (the fashion_mnist target; demo.cmake and
// getting_started.cmake add their tests only then): the directory of the example programs, and
// the fashion_mnist example in it.
const std::string& examples_dir();
const std::string& fashion_mnist_program();

}  // namespace shoal::testing
