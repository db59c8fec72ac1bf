# ctest's build_tree_package: configures tests/install/build_tree against the build tree
# BUILD_DIR in a fresh temporary directory (cmake -P; arguments BUILD_DIR, GENERATOR, CXX,
# SOURCE_DIR), and fails with its output when it does not configure.
string(RANDOM LENGTH 8 _tag)
set(_work "${BUILD_DIR}/build_tree_package.${_tag}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${_work}" -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX}"
          "-Ddwgraph_DIR=${BUILD_DIR}"
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
file(REMOVE_RECURSE "${_work}")
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "configuring a project with find_package(dwgraph) in the build tree failed:\n${_out}\n${_err}")
endif()
message(STATUS "${_out}")
