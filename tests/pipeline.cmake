# Pipelines (docs/pipeline.md).
# The backward's split into I and W against one backward (white-box: the class is private).
shoal_add_test(pipeline_split_test pipeline_split_test.cpp)
target_include_directories(pipeline_split_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
