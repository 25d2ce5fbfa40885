# The API's headers carry no c10d header (docs/design.md): the compiler lists what a translation
# unit including only <shoal/shoal.h> reads, and none of it may be under c10d/. Run as
#   cmake -DCXX=... -DINCLUDES="a;b" -DSOURCE_DIR=... -DWORK_DIR=... -P public_headers.cmake
set(unit "${WORK_DIR}/public_headers_unit.cpp")
file(WRITE "${unit}" "#include <shoal/shoal.h>\n")
set(flags -std=c++17 -M -I${SOURCE_DIR}/include)
foreach(dir IN LISTS INCLUDES)
  list(APPEND flags -I${dir})
endforeach()
execute_process(COMMAND ${CXX} ${flags} ${unit} RESULT_VARIABLE failed OUTPUT_VARIABLE read
                ERROR_VARIABLE errors TIMEOUT 120)
if(failed)
  message(FATAL_ERROR "<shoal/shoal.h> alone does not compile: ${errors}")
endif()
# make's dependency line: paths separated by spaces, lines continued with backslashes.
string(REGEX REPLACE "[ \t\r\n\\]+" ";" files "${read}")
set(c10d ${files})
list(FILTER c10d INCLUDE REGEX "/c10d/")
if(c10d)
  message(FATAL_ERROR "<shoal/shoal.h> reads c10d's headers: ${c10d}")
endif()
set(internal ${files})
list(FILTER internal INCLUDE REGEX "^${SOURCE_DIR}/src/")
if(internal)
  message(FATAL_ERROR "<shoal/shoal.h> reads shoal's internal headers: ${internal}")
endif()
message(STATUS "<shoal/shoal.h> reads no c10d and no internal header")
