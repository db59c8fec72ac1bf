# Install rules. Two packages come out of one build:
#  * the C++ package (components runtime and dev, what `cmake --install` installs):
#    lib/libdwgraph.so, include/dwgraph/... with the umbrella <dwgraph/dwgraph.h>, and
#    lib/cmake/dwgraph/ with the exported target dwgraph::dwgraph;
#  * the Python package (component python, excluded from a plain `cmake --install`):
#    dwgraph/_C*.so and dwgraph/libdwgraph.so, which scikit-build-core puts next to the
#    Python sources in the wheel (pyproject.toml).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Generates the public headers in their installed layout under <out_dir>/dwgraph (see
# cmake/dwgraph_public_header.cmake) at build time; <target> builds them.
function(dwgraph_public_headers target out_dir)
  string(REPLACE ";" "," _components "${DWGRAPH_COMPONENTS}")
  set(_script "${PROJECT_SOURCE_DIR}/cmake/dwgraph_public_header.cmake")
  set(_outputs "")
  foreach(_h IN LISTS DWGRAPH_PUBLIC_HEADERS ITEMS "include/dwgraph/dwgraph.h")
    string(REGEX REPLACE "^include/dwgraph/" "" _rel "${_h}")
    set(_out "${out_dir}/dwgraph/${_rel}")
    add_custom_command(OUTPUT "${_out}"
      COMMAND "${CMAKE_COMMAND}" "-DIN=${PROJECT_SOURCE_DIR}/${_h}" "-DOUT=${_out}"
              "-DCOMPONENTS=${_components}" -P "${_script}"
      DEPENDS "${PROJECT_SOURCE_DIR}/${_h}" "${_script}"
      VERBATIM)
    list(APPEND _outputs "${_out}")
  endforeach()
  add_custom_target(${target} ALL DEPENDS ${_outputs})
endfunction()

function(dwgraph_install)
  set(_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/dwgraph")
  # A wheel's libraries find torch relative to themselves; a C++ install finds the torch it
  # was built against where it lies.
  if(SKBUILD)
    set(_rpath "${DWGRAPH_PACKAGE_RPATH}")
  else()
    set(_rpath "$ORIGIN;${DWGRAPH_RUNTIME_RPATH}")
  endif()
  set_target_properties(dwgraph PROPERTIES INSTALL_RPATH "${_rpath}")

  install(TARGETS dwgraph EXPORT dwgraphTargets
    LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}" COMPONENT runtime)
  install(DIRECTORY "${PROJECT_BINARY_DIR}/include/dwgraph"
    DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}" COMPONENT dev)
  install(EXPORT dwgraphTargets NAMESPACE dwgraph::
    DESTINATION "${_cmake_dir}" COMPONENT dev)
  configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/dwgraphConfig.cmake.in"
    "${PROJECT_BINARY_DIR}/dwgraphConfig.cmake" INSTALL_DESTINATION "${_cmake_dir}")
  # 0.x: a new minor version may change the API.
  write_basic_package_version_file("${PROJECT_BINARY_DIR}/dwgraphConfigVersion.cmake"
    COMPATIBILITY SameMinorVersion)
  install(FILES "${PROJECT_BINARY_DIR}/dwgraphConfig.cmake" "${PROJECT_BINARY_DIR}/dwgraphConfigVersion.cmake"
                "${PROJECT_SOURCE_DIR}/cmake/dwgraphTorchTarget.cmake"
    DESTINATION "${_cmake_dir}" COMPONENT dev)
  # The build tree is a package too: dwgraphConfig.cmake above sits in the build directory
  # next to what it includes, so find_package(dwgraph) with dwgraph_DIR (or
  # CMAKE_PREFIX_PATH) at the build directory gives this build's library and headers.
  export(EXPORT dwgraphTargets NAMESPACE dwgraph:: FILE "${PROJECT_BINARY_DIR}/dwgraphTargets.cmake")
  configure_file("${PROJECT_SOURCE_DIR}/cmake/dwgraphTorchTarget.cmake" "${PROJECT_BINARY_DIR}/dwgraphTorchTarget.cmake"
    COPYONLY)

  if(DWGRAPH_BUILD_PYTHON)
    set_target_properties(dwgraph_python PROPERTIES INSTALL_RPATH "${_rpath}")
    install(TARGETS dwgraph_python dwgraph LIBRARY DESTINATION dwgraph COMPONENT python EXCLUDE_FROM_ALL)
  endif()
endfunction()
