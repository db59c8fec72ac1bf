# Finds LibTorch (from the Python environment's torch wheel) and decides whether the CUDA
# sources are compiled. Produces:
#   DWGRAPH_WITH_CUDA        ON when the CUDA sources are compiled
#   dwgraph::torch           LibTorch (host libraries, plus the CUDA ones when built with CUDA);
#                            an imported target, made by cmake/dwgraphTorchTarget.cmake, which
#                            the installed dwgraphConfig.cmake uses the same way
#   dwgraph::torch_python    libtorch_python, for the extension
#   dwgraph::cublaslt        cuBLASLt (only when DWGRAPH_WITH_CUDA)
#   DWGRAPH_RUNTIME_RPATH    where the built binaries find LibTorch and the CUDA libraries
#                            (absolute: build tree and `cmake --install`)
#   DWGRAPH_PACKAGE_RPATH    the same relative to the installed Python package dwgraph/
#                            ($ORIGIN/../torch/lib, ...: the wheel finds torch's own libraries)
#   DWGRAPH_TORCH_CMAKE_PREFIX, DWGRAPH_TORCH_ROOT, DWGRAPH_TORCH_VERSION,
#   DWGRAPH_TORCH_CXX11_ABI, DWGRAPH_NVCC, DWGRAPH_CUDA_ROOT   recorded in the installed config
#
# Note [Why two ways to import LibTorch]: TorchConfig.cmake of a CUDA wheel insists on a
# CUDA toolkit (it enables the CUDA language and fails without nvcc). We use it whenever
# the CUDA sources are compiled, which is the supported configuration. For a host-only
# build (DWGRAPH_CUDA=OFF, or AUTO with no matching nvcc) we import the host libraries
# directly, so a machine without a toolkit can still build and test the host path.

include("${CMAKE_CURRENT_LIST_DIR}/dwgraphTorchTarget.cmake")

execute_process(
  COMMAND "${Python3_EXECUTABLE}" -c
    "import torch, os; print(torch.utils.cmake_prefix_path); print(torch.version.cuda or ''); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(os.path.dirname(os.path.dirname(torch.__file__))); print(torch.__version__)"
  OUTPUT_VARIABLE _dw_torch_info
  RESULT_VARIABLE _dw_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _dw_torch_rc EQUAL 0)
  message(FATAL_ERROR "dwgraph: cannot import torch with ${Python3_EXECUTABLE}; run scripts/setup")
endif()
string(REPLACE "\n" ";" _dw_torch_info "${_dw_torch_info}")
list(GET _dw_torch_info 0 DWGRAPH_TORCH_CMAKE_PREFIX)
list(GET _dw_torch_info 1 DWGRAPH_TORCH_CUDA_VERSION)
list(GET _dw_torch_info 2 DWGRAPH_TORCH_CXX11_ABI)
list(GET _dw_torch_info 3 DWGRAPH_SITE_PACKAGES)
list(GET _dw_torch_info 4 DWGRAPH_TORCH_VERSION)
get_filename_component(DWGRAPH_TORCH_ROOT "${DWGRAPH_TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
message(STATUS "dwgraph: torch ${DWGRAPH_TORCH_VERSION} at ${DWGRAPH_TORCH_ROOT}, CUDA '${DWGRAPH_TORCH_CUDA_VERSION}'")

# --- decide whether to compile the CUDA sources -------------------------------------------
# nvcc: the user's CMAKE_CUDA_COMPILER, else CUDA_HOME, then PATH, then /usr/local/cuda, then
# a PyPI nvidia-cuda-nvcc in the venv.
if(CMAKE_CUDA_COMPILER AND NOT DWGRAPH_NVCC)
  set(DWGRAPH_NVCC "${CMAKE_CUDA_COMPILER}" CACHE FILEPATH "nvcc dwgraph compiles against")
endif()
find_program(DWGRAPH_NVCC nvcc
  HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin" /usr/local/cuda/bin
        "${DWGRAPH_SITE_PACKAGES}/nvidia/cu13/bin" "${DWGRAPH_SITE_PACKAGES}/nvidia/cuda_nvcc/bin")
set(_dw_nvcc_major "")
if(DWGRAPH_NVCC)
  execute_process(COMMAND "${DWGRAPH_NVCC}" --version OUTPUT_VARIABLE _dw_nvcc_out ERROR_QUIET)
  if(_dw_nvcc_out MATCHES "release ([0-9]+)\\.([0-9]+)")
    set(_dw_nvcc_major "${CMAKE_MATCH_1}")
  endif()
endif()
string(REGEX MATCH "^[0-9]+" _dw_torch_cuda_major "${DWGRAPH_TORCH_CUDA_VERSION}")

set(_dw_cuda_missing "")
if(NOT _dw_torch_cuda_major)
  set(_dw_cuda_missing "the installed torch ${DWGRAPH_TORCH_VERSION} is a CPU-only build (torch.version.cuda is None)")
elseif(NOT DWGRAPH_NVCC)
  set(_dw_cuda_missing "no nvcc was found (looked in CUDA_HOME, PATH, /usr/local/cuda/bin and the venv's nvidia packages)")
elseif(NOT _dw_nvcc_major STREQUAL _dw_torch_cuda_major)
  set(_dw_cuda_missing "nvcc at ${DWGRAPH_NVCC} is CUDA ${_dw_nvcc_major} but torch was built with CUDA ${DWGRAPH_TORCH_CUDA_VERSION}; install a matching compiler (pip install nvidia-cuda-nvcc for CUDA ${_dw_torch_cuda_major}) or set CUDA_HOME")
endif()

string(TOUPPER "${DWGRAPH_CUDA}" _dw_cuda_mode)
if(_dw_cuda_mode STREQUAL "OFF")
  set(DWGRAPH_WITH_CUDA OFF)
elseif(_dw_cuda_missing STREQUAL "")
  set(DWGRAPH_WITH_CUDA ON)
elseif(_dw_cuda_mode STREQUAL "ON")
  message(FATAL_ERROR "dwgraph: DWGRAPH_CUDA=ON but the CUDA sources cannot be compiled: ${_dw_cuda_missing}")
else()
  message(WARNING "dwgraph: building the host path only: ${_dw_cuda_missing}")
  set(DWGRAPH_WITH_CUDA OFF)
endif()

set(DWGRAPH_RUNTIME_RPATH "${DWGRAPH_TORCH_ROOT}/lib")
set(DWGRAPH_CUDA_ROOT "")

if(DWGRAPH_WITH_CUDA)
  get_filename_component(_dw_cuda_root "${DWGRAPH_NVCC}" DIRECTORY)
  get_filename_component(_dw_cuda_root "${_dw_cuda_root}" DIRECTORY)
  set(DWGRAPH_CUDA_ROOT "${_dw_cuda_root}")
  # TorchConfig enables the CUDA language and runs FindCUDA: point both at the nvcc checked
  # above, unless the user chose a compiler or a toolkit (defaults, never forced).
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    set(CMAKE_CUDA_COMPILER "${DWGRAPH_NVCC}" CACHE FILEPATH "CUDA compiler")
  endif()
  if(NOT CUDA_TOOLKIT_ROOT_DIR)
    set(CUDA_TOOLKIT_ROOT_DIR "${_dw_cuda_root}" CACHE PATH "CUDA toolkit (FindCUDA, used by TorchConfig)")
  endif()
  # Only the architectures we test on; every extra one multiplies nvcc time. (Read by
  # TorchConfig in this configure process only.)
  if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0")
  endif()
  set(Torch_DIR "${DWGRAPH_TORCH_CMAKE_PREFIX}/Torch")  # the Python environment's torch, always
  find_package(Torch REQUIRED)
  dwgraph_torch_target(CUDA ROOT "${TORCH_INSTALL_PREFIX}" LIBRARIES ${TORCH_LIBRARIES})

  # cuBLASLt: the copy the torch wheel ships (the one torch itself loads), headers from the
  # toolkit. Linking the toolkit's copy could load an older libcublasLt.so.N first.
  find_library(DWGRAPH_CUBLASLT_LIB NAMES cublasLt libcublasLt.so.${_dw_torch_cuda_major}
    HINTS "${DWGRAPH_SITE_PACKAGES}/nvidia/cu${_dw_torch_cuda_major}/lib"
          "${DWGRAPH_SITE_PACKAGES}/nvidia/cublas/lib" "${_dw_cuda_root}/lib64"
    NO_DEFAULT_PATH)
  if(NOT DWGRAPH_CUBLASLT_LIB)
    message(FATAL_ERROR "dwgraph: cuBLASLt not found next to torch or in ${_dw_cuda_root}")
  endif()
  add_library(dwgraph_cublaslt INTERFACE)
  target_link_libraries(dwgraph_cublaslt INTERFACE "${DWGRAPH_CUBLASLT_LIB}" CUDA::cudart)
  target_include_directories(dwgraph_cublaslt SYSTEM INTERFACE "${_dw_cuda_root}/include")
  add_library(dwgraph::cublaslt ALIAS dwgraph_cublaslt)
  # The wheel's CUDA libraries first, so the loader never mixes toolkit and wheel copies.
  foreach(_dw_dir "nvidia/cu${_dw_torch_cuda_major}/lib" "nvidia/cublas/lib" "nvidia/cuda_runtime/lib"
                  "nvidia/cudnn/lib" "nvidia/nccl/lib" "nvidia/nvshmem/lib" "nvidia/cusparselt/lib")
    if(EXISTS "${DWGRAPH_SITE_PACKAGES}/${_dw_dir}")
      list(APPEND DWGRAPH_RUNTIME_RPATH "${DWGRAPH_SITE_PACKAGES}/${_dw_dir}")
    endif()
  endforeach()
else()
  dwgraph_torch_target(HOST ROOT "${DWGRAPH_TORCH_ROOT}" CXX11_ABI ${DWGRAPH_TORCH_CXX11_ABI})
endif()

# Used through add_subdirectory, the parent links dwgraph::dwgraph from its own directory,
# where the imported targets it names (dwgraph::torch and TorchConfig's) must be visible.
if(NOT PROJECT_IS_TOP_LEVEL)
  get_property(_dw_imported DIRECTORY PROPERTY IMPORTED_TARGETS)
  foreach(_dw_target IN LISTS _dw_imported)
    set_property(TARGET ${_dw_target} PROPERTY IMPORTED_GLOBAL TRUE)
  endforeach()
endif()

# The same directories relative to the installed package site-packages/dwgraph, so a wheel
# finds torch's own libraries (and the nvidia wheels') wherever the environment lives.
set(DWGRAPH_PACKAGE_RPATH "$ORIGIN")
foreach(_dw_dir IN LISTS DWGRAPH_RUNTIME_RPATH)
  file(RELATIVE_PATH _dw_rel "${DWGRAPH_SITE_PACKAGES}" "${_dw_dir}")
  list(APPEND DWGRAPH_PACKAGE_RPATH "$ORIGIN/../${_dw_rel}")
endforeach()

add_library(dwgraph_torch_python INTERFACE)
target_link_libraries(dwgraph_torch_python INTERFACE "${DWGRAPH_TORCH_ROOT}/lib/libtorch_python.so")
add_library(dwgraph::torch_python ALIAS dwgraph_torch_python)

# One object library per source directory (= one namespace, = one layer). DEPENDS names the
# components whose headers it may include; they become its link dependencies, and
# cmake/check_layers.cmake (run at configure time and as a ctest test) fails the build when
# a source includes a header of any other component.
set_property(GLOBAL PROPERTY DWGRAPH_LAYERS "")
function(dwgraph_add_component name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_SOURCES;DEPENDS" ${ARGN})
  set(_srcs ${ARG_SOURCES})
  if(DWGRAPH_WITH_CUDA)
    list(APPEND _srcs ${ARG_CUDA_SOURCES})
  endif()
  set(_target dwgraph_${name})
  add_library(${_target} OBJECT ${_srcs})
  set_target_properties(${_target} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_compile_features(${_target} PUBLIC cxx_std_17)
  target_include_directories(${_target} PUBLIC "${PROJECT_SOURCE_DIR}")
  target_link_libraries(${_target} PUBLIC dwgraph::torch)
  foreach(_dep IN LISTS ARG_DEPENDS)
    target_link_libraries(${_target} PUBLIC dwgraph_${_dep})
  endforeach()
  if(DWGRAPH_WITH_CUDA)
    target_link_libraries(${_target} PRIVATE dwgraph::cublaslt)
    target_compile_definitions(${_target} PUBLIC DWGRAPH_WITH_CUDA=1)
  endif()
  target_compile_options(${_target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
  string(REPLACE ";" "," _deps "${ARG_DEPENDS}")
  set_property(GLOBAL APPEND PROPERTY DWGRAPH_LAYERS "${name}=${_deps}")
endfunction()
