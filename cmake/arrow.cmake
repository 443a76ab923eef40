# Apache Arrow's C++ libraries and headers (arrow, parquet) from the pyarrow wheel of the project's
# Python environment (.venv, made by scripts/setup.sh), as LibTorch comes from the torch wheel. The
# wheel has no unversioned libarrow.so, so the libraries are imported by their SONAME file.
#
# Defines the INTERFACE target titan_arrow (links libarrow and libparquet; their include folder as a
# SYSTEM include), TITAN_PYARROW_DIR and TITAN_ARROW_COMPILE_OPTIONS (that include folder as -isystem,
# for a single source that needs the headers when its target should not see them).
if(TARGET titan_arrow)
  return()
endif()
get_filename_component(_titan_root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
if(EXISTS "${_titan_root}/.venv/bin/python")
  set(_titan_arrow_py "${_titan_root}/.venv/bin/python")
else()
  find_program(_titan_arrow_py NAMES python3 python)
endif()
execute_process(COMMAND "${_titan_arrow_py}" -c "import os, pyarrow; print(os.path.dirname(pyarrow.__file__), end='')"
                OUTPUT_VARIABLE TITAN_PYARROW_DIR ERROR_VARIABLE _titan_arrow_err RESULT_VARIABLE _titan_arrow_rc)
if(NOT _titan_arrow_rc EQUAL 0 OR NOT IS_DIRECTORY "${TITAN_PYARROW_DIR}/include/arrow")
  message(FATAL_ERROR "Apache Arrow's C++ libraries come from the pyarrow wheel, but ${_titan_arrow_py} has no pyarrow "
                      "(or it lacks include/arrow): run scripts/setup.sh, which installs it into .venv.\n${_titan_arrow_err}")
endif()

add_library(titan_arrow INTERFACE)
foreach(_lib arrow parquet)
  # libarrow.so.2600 (the SONAME) rather than libarrow.so.2600.1.0 where both exist: the shortest name.
  file(GLOB _found "${TITAN_PYARROW_DIR}/lib${_lib}.so.*")
  set(_best "")
  foreach(_f ${_found})
    string(LENGTH "${_f}" _len)
    string(LENGTH "${_best}" _best_len)
    if(_best STREQUAL "" OR _len LESS _best_len)
      set(_best "${_f}")
    endif()
  endforeach()
  if(_best STREQUAL "")
    message(FATAL_ERROR "no lib${_lib}.so.* in ${TITAN_PYARROW_DIR}: is pyarrow installed whole? run scripts/setup.sh")
  endif()
  add_library(titan_arrow_${_lib} SHARED IMPORTED)
  set_target_properties(titan_arrow_${_lib} PROPERTIES IMPORTED_LOCATION "${_best}"
                        INTERFACE_INCLUDE_DIRECTORIES "${TITAN_PYARROW_DIR}/include")
  target_link_libraries(titan_arrow INTERFACE titan_arrow_${_lib})
endforeach()
set(TITAN_ARROW_COMPILE_OPTIONS "-isystem;${TITAN_PYARROW_DIR}/include")
message(STATUS "titan: Apache Arrow from ${TITAN_PYARROW_DIR}")
