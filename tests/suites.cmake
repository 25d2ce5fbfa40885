# shoal_discover_suites(target [TEST_PREFIX p] [TEST_FILTER f] [PROPERTIES ...])
# Note [One ctest test per suite]: as gtest_discover_tests, but a ctest test runs a whole GoogleTest
# suite (every case of it that TEST_FILTER keeps) in one process. Starting a test binary costs about
# a second of CPU on the CI machine (ld.so's relocations of LibTorch, page faults, its operator
# registrations: docs/testing.md), which a ctest test per case paid 549 times on 2026-11-28 and a
# test per suite pays 99 times. A case's failure still names the case (GoogleTest's output, under the
# suite's ctest test), and every case still has its own deadline: PROPERTIES TIMEOUT is per case,
# passed to the binary as SHOAL_TEST_CASE_TIMEOUT, whose watchdog (tests/main.cpp) fails a case
# that overruns it with the case's name; the ctest test's TIMEOUT is that times its cases. A suite
# whose every case skipped exits 77, which ctest reports as skipped (SKIP_RETURN_CODE).
# Run one case: the binary itself, `tests/dp_test --gtest_filter=DataParallel.AJobOfOneIsPlainTraining`.
set(SHOAL_SUITES_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/suites_add.cmake)

function(shoal_discover_suites target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TEST_PREFIX;TEST_FILTER" "PROPERTIES")
  get_property(counter TARGET ${target} PROPERTY SHOAL_SUITES_COUNTER)
  if(NOT counter)
    set(counter 0)
  endif()
  math(EXPR counter "${counter} + 1")
  set_property(TARGET ${target} PROPERTY SHOAL_SUITES_COUNTER ${counter})
  set(base "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites_${counter}")
  add_custom_command(
    TARGET ${target} POST_BUILD
    BYPRODUCTS "${base}_tests.cmake"
    COMMAND "${CMAKE_COMMAND}"
            -D "EXECUTABLE=$<TARGET_FILE:${target}>"
            -D "WORKING_DIR=${CMAKE_CURRENT_BINARY_DIR}"
            -D "PREFIX=${arg_TEST_PREFIX}"
            -D "FILTER=${arg_TEST_FILTER}"
            -D "PROPERTIES=${arg_PROPERTIES}"
            -D "OUTPUT=${base}_tests.cmake"
            -P "${SHOAL_SUITES_SCRIPT}"
    VERBATIM)
  file(WRITE "${base}_include.cmake"
       "if(EXISTS \"${base}_tests.cmake\")\n"
       "  include(\"${base}_tests.cmake\")\n"
       "else()\n"
       "  add_test(${target}_NOT_BUILT ${target}_NOT_BUILT)\n"
       "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${base}_include.cmake")
endfunction()
