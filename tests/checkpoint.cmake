# Checkpoints (docs/checkpoint.md): save, load, resume on another worker count, bad files.
# Included from tests/CMakeLists.txt with include(checkpoint.cmake).
shoal_add_test(checkpoint_test checkpoint_test.cpp)
target_link_libraries(checkpoint_test PRIVATE ZLIB::ZLIB)  # the test writes headers of its own
