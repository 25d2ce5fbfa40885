# The Python package's tests (tests/python/test_*.py, docs/python.md): pytest from Debian's
# python3-pytest under Debian's /usr/bin/python3, the package from the build tree, multi-worker
# cases through `shoal run`. Included from tests/CMakeLists.txt.
if(TARGET shoal_python)
  # The C++ half of tests/python/test_checkpoint.py: the same program as checkpoint_worker.py.
  add_executable(checkpoint_interop programs/checkpoint_interop.cpp)
  shoal_program(checkpoint_interop)
  add_test(NAME Python
    COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_SOURCE_DIR}/python)
  set_tests_properties(Python PROPERTIES TIMEOUT 600 COST 30
    ENVIRONMENT "PYTHONPATH=${PROJECT_BINARY_DIR}/python;SHOAL_BIN=${PROJECT_BINARY_DIR}/bin/shoal;SHOAL_TEST_PROGRAMS=${CMAKE_CURRENT_BINARY_DIR};SHOAL_EXAMPLES=${PROJECT_BINARY_DIR}/examples;PYTHONDONTWRITEBYTECODE=1")
endif()
