# The installed copy (tests/install_test.sh): `cmake --install` into a temporary prefix, a program
# outside the tree built with find_package(shoal) and with pkg-config and run under `shoal run`;
# and the Debian packages `cpack -G DEB` makes. Both need the library and the command built.
foreach(mode install deb)
  add_test(NAME install_${mode}
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/install_test.sh ${mode} ${PROJECT_BINARY_DIR}
            ${PROJECT_SOURCE_DIR})
  set_tests_properties(install_${mode} PROPERTIES TIMEOUT 1500 SKIP_RETURN_CODE 77 COST 80)
endforeach()
