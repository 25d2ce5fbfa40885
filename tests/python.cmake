# The Python package's tests (tests/python/test_*.py, docs/python.md): pytest from Debian's
# python3-pytest under Debian's /usr/bin/python3, the package from the build tree, multi-worker
# cases through `shoal run`. One ctest test per file (Python.<file>), so that they spread over
# ctest's slots beside the C++ suites, each with its own deadline. Included from
# tests/CMakeLists.txt.
if(TARGET shoal_python)
  # The C++ half of tests/python/test_checkpoint.py: the same program as checkpoint_worker.py.
  add_executable(checkpoint_interop programs/checkpoint_interop.cpp)
  shoal_program(checkpoint_interop)
  file(GLOB python_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/python/test_*.py)
  foreach(test_file ${python_tests})
    get_filename_component(name ${test_file} NAME_WE)
    string(REGEX REPLACE "^test_" "" name ${name})
    add_test(NAME Python.${name}
      COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${test_file})
    # Long files first (Note [Long tests start first] in tests/CMakeLists.txt): seconds unloaded.
    set(cost 10)
    if(name MATCHES "^(examples|getting_started|checkpoint|elastic)$")
      set(cost 40)
    endif()
    set_tests_properties(Python.${name} PROPERTIES TIMEOUT 600 COST ${cost}
      ENVIRONMENT "PYTHONPATH=${PROJECT_BINARY_DIR}/python;SHOAL_BIN=${PROJECT_BINARY_DIR}/bin/shoal;SHOAL_TEST_PROGRAMS=${CMAKE_CURRENT_BINARY_DIR};SHOAL_EXAMPLES=${PROJECT_BINARY_DIR}/examples;PYTHONDONTWRITEBYTECODE=1")
  endforeach()
endif()
