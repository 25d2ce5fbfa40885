# Script of shoal_discover_suites (tests/suites.cmake, Note [One ctest test per suite]): lists a
# test binary's cases and writes OUTPUT, a ctest file with one test per GoogleTest suite.
# -D EXECUTABLE, WORKING_DIR, PREFIX, FILTER, PROPERTIES (name value... pairs, TIMEOUT and COST
# per case), OUTPUT.
cmake_minimum_required(VERSION 3.18)  # IN_LIST
set(args --gtest_list_tests)
if(FILTER)
  list(APPEND args "--gtest_filter=${FILTER}")
endif()
execute_process(COMMAND "${EXECUTABLE}" ${args} WORKING_DIRECTORY "${WORKING_DIR}" TIMEOUT 120
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors RESULT_VARIABLE result)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "${EXECUTABLE} --gtest_list_tests failed (${result}):\n${listing}${errors}")
endif()

# The properties, per case as given; each takes the values after its name. TIMEOUT and COST are
# per case, the rest pass on as they are, each as one argument (a list).
set(names TIMEOUT COST RESOURCE_LOCK ENVIRONMENT RUN_SERIAL LABELS PROCESSORS)
set(given "")
set(current "")
foreach(item IN LISTS PROPERTIES)
  if(item IN_LIST names)
    set(current ${item})
    list(APPEND given ${item})
    set(value_${item} "")
  elseif(current STREQUAL "")
    message(FATAL_ERROR "shoal_discover_suites: PROPERTIES must start with one of ${names}, got '${item}'")
  else()
    list(APPEND value_${current} "${item}")
  endif()
endforeach()
set(case_timeout 300)
if(value_TIMEOUT)
  set(case_timeout ${value_TIMEOUT})
endif()
set(case_cost 2)
if(value_COST)
  set(case_cost ${value_COST})
endif()
list(APPEND value_ENVIRONMENT "SHOAL_TEST_CASE_TIMEOUT=${case_timeout}")
list(APPEND given ENVIRONMENT)
list(REMOVE_DUPLICATES given)
list(REMOVE_ITEM given TIMEOUT COST)
set(passed "")
foreach(name IN LISTS given)
  string(APPEND passed " ${name} [==[${value_${name}}]==]")
endforeach()

# GoogleTest's listing: "Suite." (maybe "  # TypeParam = ..."), then "  Case" (maybe "  # GetParam() = ...").
string(REPLACE "\n" ";" lines "${listing}")
set(suites "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "  #.*$" "" line "${line}")
  if(line MATCHES "^([^ ].*)\\.$")
    set(suite "${CMAKE_MATCH_1}")
    list(APPEND suites "${suite}")
    set(cases_${suite} "")
  elseif(line MATCHES "^  ([^ ]+)$")
    list(APPEND cases_${suite} "${suite}.${CMAKE_MATCH_1}")
  endif()
endforeach()

set(content "")
foreach(suite IN LISTS suites)
  list(LENGTH cases_${suite} count)
  if(count EQUAL 0)
    continue()
  endif()
  list(JOIN cases_${suite} ":" filter)
  math(EXPR timeout "${case_timeout} * ${count}")
  math(EXPR cost "${case_cost} * ${count}")
  set(name "${PREFIX}${suite}")
  string(APPEND content
         "add_test([==[${name}]==] [==[${EXECUTABLE}]==] [==[--gtest_filter=${filter}]==])\n"
         "set_tests_properties([==[${name}]==] PROPERTIES WORKING_DIRECTORY [==[${WORKING_DIR}]==]"
         " SKIP_RETURN_CODE 77 TIMEOUT ${timeout} COST ${cost}${passed})\n")
endforeach()
file(WRITE "${OUTPUT}" "${content}")
