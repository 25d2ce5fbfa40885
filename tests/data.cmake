# The data part (docs/data.md): the sampler and the loader.
# Included from tests/CMakeLists.txt with include(data.cmake OPTIONAL).
shoal_add_test(sampler_test sampler_test.cpp)
shoal_add_test(synthetic_ctr_test synthetic_ctr_test.cpp)
if(TARGET ctr)
  shoal_add_test(ctr_example_test ctr_example_test.cpp PROPERTIES COST 150)
  add_dependencies(ctr_example_test ctr shoal_cli)
endif()
