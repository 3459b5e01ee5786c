# The install rules (cmake/Packaging.cmake says which package each component becomes). Paths are
# relative to the prefix (/usr for the packages) except the configuration, which
# cmake/InstallDeployFiles.cmake puts in /etc.
set(_kvpool_doc share/doc)

# --- kvpool (component daemon) -----------------------------------------------------------------
install(TARGETS kvpoold kvpoolctl kvpool-replay kvpool-loadgen RUNTIME DESTINATION bin
        COMPONENT daemon)
# (libkvpool_cuda.so, when built: kernels/cuda/CMakeLists.txt, into lib/kvpool.)
install(FILES ${PROJECT_SOURCE_DIR}/deploy/kvpoold.sysusers DESTINATION lib/sysusers.d
        RENAME kvpool.conf COMPONENT daemon)
install(FILES ${PROJECT_SOURCE_DIR}/deploy/kvpoold.tmpfiles DESTINATION lib/tmpfiles.d
        RENAME kvpool.conf COMPONENT daemon)
install(CODE "include(\"${PROJECT_SOURCE_DIR}/cmake/InstallDeployFiles.cmake\")
kvpool_install_unit(\"${PROJECT_SOURCE_DIR}\" \"${_kvpool_gen}\")" COMPONENT daemon)
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${_kvpool_doc}/kvpool COMPONENT daemon)
file(GLOB _kvpool_docs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/docs/*.md)
install(FILES ${_kvpool_docs} DESTINATION ${_kvpool_doc}/kvpool/docs COMPONENT daemon)

# Every package: copyright and the changelog (gzip -9n: lintian's and dpkg's expectations).
add_custom_command(
  OUTPUT ${_kvpool_gen}/changelog.gz
  COMMAND gzip -9n -c ${_kvpool_debian}/changelog > ${_kvpool_gen}/changelog.gz
  DEPENDS ${_kvpool_debian}/changelog
  COMMENT "gzip deploy/debian/changelog")
set(_kvpool_generated ${_kvpool_gen}/changelog.gz)
foreach(pair daemon:kvpool dev:kvpool-dev python:python3-kvpool frontend:kvpool-frontend)
  string(REPLACE ":" ";" pair ${pair})
  list(GET pair 0 component)
  list(GET pair 1 package)
  install(FILES ${_kvpool_debian}/copyright ${_kvpool_gen}/changelog.gz
          DESTINATION ${_kvpool_doc}/${package} COMPONENT ${component})
endforeach()

# Man pages from each program's --help (help2man; the version is the project's). Without help2man
# the packages have none (lintian then warns binary-without-manpage).
find_program(KVPOOL_HELP2MAN help2man)
# kvpool_man_page(PROGRAM target-or-path SECTION n NAME "what it is" COMPONENT c [DEPENDS t])
function(kvpool_man_page)
  cmake_parse_arguments(A "" "PROGRAM;SECTION;NAME;COMPONENT" "DEPENDS" ${ARGN})
  get_filename_component(program ${A_PROGRAM} NAME)
  if(TARGET ${A_PROGRAM})
    set(A_PROGRAM $<TARGET_FILE:${A_PROGRAM}>)
  endif()
  set(page ${_kvpool_gen}/${program}.${A_SECTION})
  add_custom_command(
    OUTPUT ${page}.gz
    COMMAND ${CMAKE_COMMAND} -E env SOURCE_DATE_EPOCH=${KVPOOL_SOURCE_DATE_EPOCH}
            ${KVPOOL_HELP2MAN} --no-info --no-discard-stderr --section=${A_SECTION}
            --version-string=${PROJECT_VERSION} --name=${A_NAME} --output=${page} ${A_PROGRAM}
    COMMAND gzip -9nf ${page}
    DEPENDS ${A_DEPENDS}
    COMMENT "help2man ${program}.${A_SECTION}"
    VERBATIM)
  set_property(GLOBAL APPEND PROPERTY KVPOOL_MAN_PAGES ${page}.gz)
  install(FILES ${page}.gz DESTINATION share/man/man${A_SECTION} COMPONENT ${A_COMPONENT})
endfunction()
if(KVPOOL_HELP2MAN)
  kvpool_man_page(PROGRAM kvpoold SECTION 8 COMPONENT daemon DEPENDS kvpoold
                  NAME "KV-cache pool daemon for LLM inference serving")
  kvpool_man_page(PROGRAM kvpoolctl SECTION 8 COMPONENT daemon DEPENDS kvpoolctl
                  NAME "inspect and operate a running kvpoold")
  kvpool_man_page(PROGRAM kvpool-replay SECTION 1 COMPONENT daemon
                  DEPENDS kvpool-replay
                  NAME "replay a Mooncake trace through kvpool's prefix cache")
  kvpool_man_page(PROGRAM kvpool-loadgen SECTION 1 COMPONENT daemon
                  DEPENDS kvpool-loadgen NAME "drive kvpoold with several client processes")
else()
  message(WARNING "kvpool: no help2man, so the packages get no man pages "
                  "(deploy/install-deps.sh installs it)")
endif()

# --- kvpool-dev (component dev) ----------------------------------------------------------------
# Headers under include/kvpool, laid out as the sources include them ("client/client.h",
# "kvpool/v1/kvpool.pb.h"): only the closure of the public client headers.
set(KVPOOL_DEV_INCLUDEDIR include/kvpool)
install(TARGETS kvpool_client kvpool_proto ARCHIVE DESTINATION ${KVPOOL_DEV_LIBDIR} COMPONENT dev)
install(FILES ${PROJECT_SOURCE_DIR}/client/block_ref.h ${PROJECT_SOURCE_DIR}/client/client.h
              ${PROJECT_SOURCE_DIR}/client/pool_mapping.h ${PROJECT_SOURCE_DIR}/client/status.h
        DESTINATION ${KVPOOL_DEV_INCLUDEDIR}/client COMPONENT dev)
install(FILES ${PROJECT_SOURCE_DIR}/kvpool/util/unique_fd.h
        DESTINATION ${KVPOOL_DEV_INCLUDEDIR}/kvpool/util COMPONENT dev)
file(GLOB _kvpool_proto_headers CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/proto/kvpool/v1/*.h)
install(FILES ${_kvpool_proto_headers} DESTINATION ${KVPOOL_DEV_INCLUDEDIR}/kvpool/v1 COMPONENT dev)
install(DIRECTORY ${PROJECT_BINARY_DIR}/kvpool/v1/ DESTINATION ${KVPOOL_DEV_INCLUDEDIR}/kvpool/v1
        COMPONENT dev FILES_MATCHING PATTERN "*.pb.h")
get_target_property(KVPOOL_PROTO_LINKS kvpool_proto INTERFACE_LINK_LIBRARIES)
get_target_property(KVPOOL_CLIENT_LINKS kvpool_client INTERFACE_LINK_LIBRARIES)
list(FILTER KVPOOL_CLIENT_LINKS EXCLUDE REGEX "nlohmann_json")  # header-only, used privately
# kvpool::util: what the client takes from it is header-only (unique_fd.h, installed above;
# status_macros.h, in its sources only), so libkvpool_client.a needs no libkvpool_util.a (and the
# package none of util's spdlog). deb_package_test links a program against the installed package:
# it fails if that stops being true.
list(FILTER KVPOOL_CLIENT_LINKS EXCLUDE REGEX "^kvpool::util$")
configure_package_config_file(
  ${PROJECT_SOURCE_DIR}/cmake/kvpoolConfig.cmake.in ${_kvpool_gen}/kvpoolConfig.cmake
  INSTALL_DESTINATION ${KVPOOL_DEV_LIBDIR}/cmake/kvpool
  PATH_VARS KVPOOL_DEV_LIBDIR KVPOOL_DEV_INCLUDEDIR)
write_basic_package_version_file(${_kvpool_gen}/kvpoolConfigVersion.cmake
                                 COMPATIBILITY ExactVersion)
install(FILES ${_kvpool_gen}/kvpoolConfig.cmake ${_kvpool_gen}/kvpoolConfigVersion.cmake
        DESTINATION ${KVPOOL_DEV_LIBDIR}/cmake/kvpool COMPONENT dev)

# --- python3-kvpool and kvpool-frontend (components python, frontend) --------------------------
if(KVPOOL_HAVE_PYTHON)
  set(_kvpool_py lib/python3/dist-packages)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/python/kvpool DESTINATION ${_kvpool_py}
          COMPONENT python FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
  install(DIRECTORY ${PROJECT_BINARY_DIR}/python/kvpool/v1 DESTINATION ${_kvpool_py}/kvpool
          COMPONENT python FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/client/frontend/kvpool_frontend
          DESTINATION share/kvpool-frontend COMPONENT frontend
          FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
  set(_kvpool_launchers "include(\"${PROJECT_SOURCE_DIR}/cmake/InstallDeployFiles.cmake\")")
  foreach(pair kvpool-frontend:kvpool_frontend kvpool-http-loadgen:kvpool_frontend.loadgen
               kvpool-frontend-keys:kvpool_frontend.keys)
    string(REPLACE ":" ";" pair ${pair})
    list(GET pair 0 program)
    list(GET pair 1 module)
    string(APPEND _kvpool_launchers "\nkvpool_install_launcher(\"${PROJECT_SOURCE_DIR}\" "
           "\"${_kvpool_gen}\" ${program} ${module})")
  endforeach()
  install(CODE "${_kvpool_launchers}" COMPONENT frontend)
  if(KVPOOL_HELP2MAN)
    set(_kvpool_fe ${PROJECT_BINARY_DIR}/client/frontend)
    kvpool_man_page(PROGRAM ${_kvpool_fe}/kvpool-frontend SECTION 1 COMPONENT frontend
                    DEPENDS kvpool_python NAME "OpenAI-compatible HTTP frontend over kvpoold")
    kvpool_man_page(PROGRAM ${_kvpool_fe}/kvpool-http-loadgen SECTION 1 COMPONENT frontend
                    DEPENDS kvpool_python NAME "load generator for OpenAI-compatible servers")
    kvpool_man_page(PROGRAM ${_kvpool_fe}/kvpool-frontend-keys SECTION 1 COMPONENT frontend
                    DEPENDS kvpool_python NAME "manage kvpool-frontend's API keys file")
  endif()
endif()

get_property(_kvpool_pages GLOBAL PROPERTY KVPOOL_MAN_PAGES)
add_custom_target(kvpool_package_files ALL DEPENDS ${_kvpool_generated} ${_kvpool_pages})
