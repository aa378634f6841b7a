# How mtplx_ext's Metal kernels ship in a macOS build.
#
#   METALLIB  Xcode's metal compiler builds mtplx_ext.metallib from
#             metal/*.metal; it is installed next to the module.
#   EMBED     the same metal/*.metal files, flattened into one source by
#             cmake/embed_metal.py, are compiled into the module as a string;
#             MLX's Metal device builds the library from it at first use.
#             For Macs with only the Command Line Tools (no metal compiler).
#   AUTO      METALLIB when `xcrun -sdk macosx metal` runs, else EMBED.

set(_MTPLX_METAL_CMAKE_DIR "${CMAKE_CURRENT_LIST_DIR}")

# Resolves AUTO into METALLIB or EMBED; any other value must be one of them.
function(mtplx_metal_mode out_var requested)
  if(requested STREQUAL "AUTO")
    # Xcode 26 can have a metal driver whose toolchain is not downloaded:
    # running it, not only finding it, tells whether it works.
    execute_process(
      COMMAND xcrun -sdk macosx metal --version
      RESULT_VARIABLE rc
      OUTPUT_QUIET ERROR_QUIET
      TIMEOUT 60)
    if(rc STREQUAL "0")
      set(mode METALLIB)
    else()
      set(mode EMBED)
    endif()
  elseif(requested STREQUAL "METALLIB" OR requested STREQUAL "EMBED")
    set(mode "${requested}")
  else()
    message(
      FATAL_ERROR
        "MTPLX_METAL_KERNELS must be AUTO, METALLIB or EMBED, not '${requested}'")
  endif()
  set(${out_var}
      "${mode}"
      PARENT_SCOPE)
endfunction()

# Adds the build rule of the embedded kernel source and sets out_var to the
# generated C++ file (defines mtplx::metal::embedded_source()).
#   METAL_DIR     folder of the *.metal files (all of them are embedded)
#   INCLUDE_DIRS  where their includes are found (as for mlx_build_metallib)
function(mtplx_embed_metal out_var)
  cmake_parse_arguments(ARG "" "METAL_DIR" "INCLUDE_DIRS" ${ARGN})
  if(NOT Python_EXECUTABLE)
    message(FATAL_ERROR "mtplx_embed_metal needs Python_EXECUTABLE")
  endif()
  file(GLOB metal_sources CONFIGURE_DEPENDS "${ARG_METAL_DIR}/*.metal")
  file(GLOB_RECURSE metal_headers CONFIGURE_DEPENDS "${ARG_METAL_DIR}/*.h")
  set(include_args)
  foreach(dir IN LISTS ARG_INCLUDE_DIRS)
    if(NOT dir STREQUAL "")
      list(APPEND include_args -I "${dir}")
    endif()
  endforeach()
  set(out "${CMAKE_CURRENT_BINARY_DIR}/mtplx_metal_embedded.cpp")
  set(script "${_MTPLX_METAL_CMAKE_DIR}/embed_metal.py")
  add_custom_command(
    OUTPUT "${out}"
    COMMAND "${Python_EXECUTABLE}" "${script}" --metal-dir "${ARG_METAL_DIR}"
            ${include_args} --out-cpp "${out}"
    DEPENDS ${metal_sources} ${metal_headers} "${script}"
    COMMENT "Embedding the Metal kernel source"
    VERBATIM)
  set(${out_var}
      "${out}"
      PARENT_SCOPE)
endfunction()

# The Metal kernels of a macOS build of `target` (the extension module).
#   MODE          AUTO, METALLIB or EMBED (see above)
#   METAL_DIR     folder of the *.metal files
#   INCLUDE_DIRS  where their includes are found (metal/ and MLX's)
# METALLIB needs MLX's mlx_build_metallib; EMBED adds the generated source
# to the target and defines MTPLX_METAL_EMBEDDED for the eval_gpu glue.
function(mtplx_metal_kernels target)
  cmake_parse_arguments(ARG "" "MODE;METAL_DIR" "INCLUDE_DIRS" ${ARGN})
  mtplx_metal_mode(mode "${ARG_MODE}")
  message(STATUS "mtplx_ext Metal kernels: ${mode}")
  if(mode STREQUAL "METALLIB")
    file(GLOB metal_sources CONFIGURE_DEPENDS "${ARG_METAL_DIR}/*.metal")
    file(GLOB metal_headers CONFIGURE_DEPENDS "${ARG_METAL_DIR}/*.h")
    mlx_build_metallib(
      TARGET mtplx_metallib
      TITLE mtplx_ext
      SOURCES ${metal_sources}
      INCLUDE_DIRS ${ARG_INCLUDE_DIRS}
      DEPS ${metal_headers}
      OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
    add_dependencies(${target} mtplx_metallib)
    install(FILES ${CMAKE_CURRENT_BINARY_DIR}/mtplx_ext.metallib
            DESTINATION mtplx_ext)
  else()
    mtplx_embed_metal(cpp METAL_DIR "${ARG_METAL_DIR}" INCLUDE_DIRS
                      ${ARG_INCLUDE_DIRS})
    target_sources(${target} PRIVATE "${cpp}")
    target_compile_definitions(${target} PRIVATE MTPLX_METAL_EMBEDDED=1)
  endif()
endfunction()
