# The README's demo end to end (examples/fashion_mnist under `shoal run`).
# Included from tests/CMakeLists.txt with include(demo.cmake) when the examples are built.
shoal_add_test(demo_test demo_test.cpp PROPERTIES COST 80)
add_dependencies(demo_test fashion_mnist shoal_cli)
