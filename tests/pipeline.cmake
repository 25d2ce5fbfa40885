# Pipeline parallelism (docs/pipeline.md). Included from tests/CMakeLists.txt.
# Schedules as data: pure logic on the lists, built without torch or the test harness.
add_executable(pipeline_schedule_test pipeline_schedule_test.cpp)
target_link_libraries(pipeline_schedule_test PRIVATE shoal_schedule GTest::gtest_main)
target_compile_options(pipeline_schedule_test PRIVATE ${SHOAL_WARNINGS})
gtest_discover_tests(pipeline_schedule_test DISCOVERY_TIMEOUT 60 PROPERTIES TIMEOUT 120)
# The backward split into I and W against one backward (white-box: the class is private).
shoal_add_test(pipeline_split_test pipeline_split_test.cpp)
target_include_directories(pipeline_split_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
# The pipeline runtime (docs/pipeline.md): every schedule on real workers against one process,
# uneven stages, tied weights, and its errors (a wrong activation shape, a killed stage).
shoal_add_test(pipeline_test pipeline_test.cpp PROPERTIES RESOURCE_LOCK timing)
if(TARGET pipeline_mlp)
  # examples/pipeline_mlp.cpp under `shoal run -n 2` in each schedule, against one process.
  shoal_add_test(pipeline_example_test pipeline_example_test.cpp)
  add_dependencies(pipeline_example_test pipeline_mlp shoal_cli)
endif()
# A pipeline's checkpoint (docs/checkpoint.md): the whole model's file, resumed under another plan.
shoal_add_test(pipeline_checkpoint_test pipeline_checkpoint_test.cpp)
# Stages of global layers (3-D): placed by their layers, member-wise transfers, against one process.
shoal_add_test(pipeline_global_test pipeline_global_test.cpp)
