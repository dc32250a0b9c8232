# cmake -DEXE=prog -DARGS="words" -DEXPECTED=code -P expect_exit.cmake
# Runs prog with the words as its arguments; fails unless it exits with code and says why on
# stderr. (WILL_FAIL would also accept a crash.)
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(COMMAND "${EXE}" ${args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "${EXPECTED}")
  message(FATAL_ERROR "${EXE} ${ARGS}: exit ${rc}, expected ${EXPECTED}\n"
    "stdout:\n${out}\nstderr:\n${err}")
endif()
if(err STREQUAL "")
  message(FATAL_ERROR "${EXE} ${ARGS}: exit ${rc} without a message on stderr")
endif()
message(STATUS "exit ${rc}: ${err}")
