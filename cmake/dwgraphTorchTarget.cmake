# dwgraph_torch_target(): the imported target dwgraph::torch, LibTorch as dwgraph compiles
# and links against it. The build (cmake/DwgraphTorch.cmake) and the installed
# dwgraphConfig.cmake both call it, so a consumer of the installed package gets the same
# LibTorch usage requirements the library was built with.
#
#   dwgraph_torch_target(CUDA ROOT ${TORCH_INSTALL_PREFIX} LIBRARIES ${TORCH_LIBRARIES})
#       after find_package(Torch): TorchConfig's targets (they carry the include
#       directories, TORCH_CXX_FLAGS and the C++ standard torch requires)
#   dwgraph_torch_target(HOST ROOT <torch package directory> CXX11_ABI <0|1>)
#       the host libraries only, without TorchConfig (Note [Why two ways to import
#       LibTorch] in cmake/DwgraphTorch.cmake)
function(dwgraph_torch_target)
  cmake_parse_arguments(ARG "CUDA;HOST" "ROOT;CXX11_ABI" "LIBRARIES" ${ARGN})
  if(NOT ARG_ROOT)
    message(FATAL_ERROR "dwgraph_torch_target: ROOT (the torch package directory) is required, got: ${ARGN}")
  endif()
  if(TARGET dwgraph::torch)
    return()
  endif()
  add_library(dwgraph::torch INTERFACE IMPORTED)
  if(ARG_CUDA)
    set_target_properties(dwgraph::torch PROPERTIES INTERFACE_LINK_LIBRARIES "${ARG_LIBRARIES}")
    # libtorch_cuda needs the CUDA wheels' libraries (NCCL, cuDNN, ...), which it finds at
    # run time through its own $ORIGIN run path. The linker of an executable must be told
    # where they are, or it takes a system copy (an older NCCL) or none.
    file(GLOB _nvidia LIST_DIRECTORIES true "${ARG_ROOT}/../nvidia/*/lib")
    foreach(_dir IN LISTS _nvidia)
      set_property(TARGET dwgraph::torch APPEND PROPERTY INTERFACE_LINK_OPTIONS "LINKER:-rpath-link,${_dir}")
    endforeach()
    return()
  endif()
  if(NOT ARG_HOST OR "${ARG_CXX11_ABI}" STREQUAL "")
    message(FATAL_ERROR "dwgraph_torch_target: expected CUDA LIBRARIES ... or HOST ROOT <dir> CXX11_ABI <0|1>, got: ${ARGN}")
  endif()
  set(_lib "${ARG_ROOT}/lib")
  foreach(_f libtorch.so libtorch_cpu.so libc10.so)
    if(NOT EXISTS "${_lib}/${_f}")
      message(FATAL_ERROR "dwgraph: ${_lib}/${_f} does not exist; expected the lib/ directory of a torch package")
    endif()
  endforeach()
  set_target_properties(dwgraph::torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${ARG_ROOT}/include;${ARG_ROOT}/include/torch/csrc/api/include"
    INTERFACE_LINK_LIBRARIES "${_lib}/libtorch.so;${_lib}/libtorch_cpu.so;${_lib}/libc10.so"
    INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${ARG_CXX11_ABI}")
  # Recent LibTorch headers need C++20 (TorchConfig.cmake then requires cxx_std_20);
  # dwgraph's own code is C++17 and compiles as either.
  file(READ "${ARG_ROOT}/share/cmake/Torch/TorchConfig.cmake" _config)
  if(_config MATCHES "cxx_std_20")
    set_target_properties(dwgraph::torch PROPERTIES INTERFACE_COMPILE_FEATURES cxx_std_20)
  endif()
endfunction()
