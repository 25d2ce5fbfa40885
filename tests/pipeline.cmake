# Pipeline parallelism (docs/pipeline.md). Included from tests/CMakeLists.txt.
# Schedules as data: pure logic on the lists, built without torch or the test harness.
add_executable(pipeline_schedule_test pipeline_schedule_test.cpp)
target_link_libraries(pipeline_schedule_test PRIVATE shoal_schedule GTest::gtest_main)
target_compile_options(pipeline_schedule_test PRIVATE ${SHOAL_WARNINGS})
gtest_discover_tests(pipeline_schedule_test DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 120)
# The backward split into I and W against one backward (white-box: the class is private).
shoal_add_test(pipeline_split_test pipeline_split_test.cpp)
target_include_directories(pipeline_split_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
