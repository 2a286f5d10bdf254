# Writes OUT: the reshard version, the source's git commit and the build
# type, for `reshard --version`. Run at every build (not only at configure),
# so the commit is the one built; configure_file leaves OUT untouched when
# nothing changed, so an unchanged tree recompiles nothing.
execute_process(COMMAND git -C "${SOURCE_DIR}" rev-parse --short=12 HEAD
                OUTPUT_VARIABLE RESHARD_COMMIT OUTPUT_STRIP_TRAILING_WHITESPACE
                ERROR_QUIET RESULT_VARIABLE not_git)
if(not_git OR RESHARD_COMMIT STREQUAL "")
  set(RESHARD_COMMIT "unknown (not built from a git checkout)")
else()
  execute_process(COMMAND git -C "${SOURCE_DIR}" status --porcelain --untracked-files=no
                  OUTPUT_VARIABLE changes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT changes STREQUAL "")
    string(APPEND RESHARD_COMMIT " with uncommitted changes")
  endif()
endif()
configure_file("${SOURCE_DIR}/cmake/version.cc.in" "${OUT}" @ONLY)
