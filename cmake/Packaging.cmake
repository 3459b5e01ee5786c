# Install rules and the Debian packages (docs/packaging.md). One command, after the release build:
#
#   cmake --build --preset release --target package
#
# writes build/release/deb/<package>_<version>_<arch>.deb with CPack's DEB generator, from the
# install rules below, for the prefix /usr:
#   kvpool           kvpoold, kvpoolctl, kvpool-replay, kvpool-loadgen, the CUDA backend when it
#                    was built (/usr/lib/kvpool/libkvpool_cuda.so), the systemd unit, sysusers
#                    and tmpfiles entries, /etc/kvpool/kvpoold.textproto (a conffile), man pages
#   kvpool-dev       the C++ client library (static) and its headers, with a CMake package
#   python3-kvpool   the Python client (/usr/lib/python3/dist-packages/kvpool)
#   kvpool-frontend  kvpool-frontend, kvpool-http-loadgen, kvpool-frontend-keys and their private
#                    modules (/usr/share/kvpool-frontend)
# The last two only when the build has the Python client (KVPOOL_HAVE_PYTHON). Maintainer
# scripts, copyright and changelog are in deploy/debian/. The package version is the project's
# (project() in CMakeLists.txt); deploy/debian/changelog must have an entry for it.
include(CMakePackageConfigHelpers)

set(_kvpool_debian ${PROJECT_SOURCE_DIR}/deploy/debian)
set(_kvpool_gen ${PROJECT_BINARY_DIR}/deb-files)  # generated files the install rules take
file(MAKE_DIRECTORY ${_kvpool_gen})

# The changelog's newest entry must be this version: a version bump without an entry would ship
# a package whose changelog contradicts it.
file(STRINGS ${_kvpool_debian}/changelog _kvpool_top LIMIT_COUNT 1)
if(NOT _kvpool_top MATCHES "^kvpool \\(${PROJECT_VERSION}\\) ")
  message(FATAL_ERROR "deploy/debian/changelog: the newest entry is '${_kvpool_top}', not "
                      "version ${PROJECT_VERSION} (project() in CMakeLists.txt): add an entry")
endif()
# Its date stamps the man pages (help2man reads SOURCE_DATE_EPOCH): the same tree, the same bytes.
file(STRINGS ${_kvpool_debian}/changelog _kvpool_date REGEX "^ -- .*  ")
list(GET _kvpool_date 0 _kvpool_date)
string(REGEX REPLACE "^ -- .*  " "" _kvpool_date "${_kvpool_date}")
execute_process(COMMAND date -d "${_kvpool_date}" +%s OUTPUT_VARIABLE KVPOOL_SOURCE_DATE_EPOCH
                OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)

# The multiarch directory for the -dev package's archives (lib/x86_64-linux-gnu on amd64).
execute_process(COMMAND dpkg-architecture -qDEB_HOST_MULTIARCH OUTPUT_VARIABLE _kvpool_multiarch
                OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(_kvpool_multiarch)
  set(KVPOOL_DEV_LIBDIR lib/${_kvpool_multiarch})
else()
  set(KVPOOL_DEV_LIBDIR lib)
endif()

include(${CMAKE_CURRENT_LIST_DIR}/PackagingFiles.cmake)

# --- CPack: one .deb per component ------------------------------------------------------------
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME kvpool)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DIRECTORY ${PROJECT_BINARY_DIR}/deb)
set(CPACK_PACKAGE_CONTACT
    "Seed 47a25398 maintainers <maintainers@users.noreply.a-seed-47a25398.example>")
# DESTDIR staging: CMAKE_INSTALL_PREFIX is /usr while the install rules run (whatever the build
# tree's own prefix), so the generated unit says /usr/bin/kvpoold, and /etc lands in the staging
# tree, never on the build machine.
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_INSTALL_DEFAULT_DIRECTORY_PERMISSIONS
    OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL daemon dev)
if(KVPOOL_HAVE_PYTHON)
  list(APPEND CPACK_COMPONENTS_ALL python frontend)
endif()
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
set(CPACK_DEBIAN_COMPRESSION_TYPE xz)

set(CPACK_DEBIAN_DAEMON_PACKAGE_NAME kvpool)
set(CPACK_DEBIAN_DAEMON_PACKAGE_SECTION misc)
set(CPACK_DEBIAN_DAEMON_PACKAGE_SHLIBDEPS ON)  # dpkg-shlibdeps over the ELF files
# sysusers and tmpfiles run from postinst (deploy/debian/kvpool/postinst).
set(CPACK_DEBIAN_DAEMON_PACKAGE_DEPENDS
    "systemd | systemd-standalone-sysusers, systemd | systemd-standalone-tmpfiles")
set(CPACK_DEBIAN_DAEMON_PACKAGE_SUGGESTS "python3-kvpool, kvpool-frontend, redis-server")
set(CPACK_DEBIAN_DAEMON_PACKAGE_CONTROL_EXTRA
    ${_kvpool_debian}/kvpool/postinst ${_kvpool_debian}/kvpool/prerm
    ${_kvpool_debian}/kvpool/postrm ${_kvpool_debian}/kvpool/conffiles)
set(CPACK_DEBIAN_DAEMON_DESCRIPTION "KV-cache pool daemon for LLM inference serving
kvpoold owns one accelerator's paged KV-cache pool and shares it with the
serving processes of the host: a prefix cache with events, lower tiers (host
memory, local disk, Redis), a model that runs over the pool, and gRPC control
over Unix sockets. This package holds the daemon, its systemd unit (installed
but not enabled), kvpoolctl to inspect and operate it, kvpool-replay and
kvpool-loadgen, and the CUDA backend when the build had nvcc.")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME kvpool-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
    "libabsl-dev, libfmt-dev, libgrpc++-dev, libprotobuf-dev, protobuf-compiler-grpc")
set(CPACK_DEBIAN_DEV_DESCRIPTION "kvpool C++ client library (static) and headers
libkvpool_client attaches to kvpoold, maps its pool and calls its RPCs; a CMake
package (find_package(kvpool)) gives the target kvpool::client. Static only:
its interface is made of Abseil and generated protobuf types, which carry no
stable ABI a shared library could promise.")

set(CPACK_DEBIAN_PYTHON_PACKAGE_NAME python3-kvpool)
set(CPACK_DEBIAN_PYTHON_PACKAGE_SECTION python)
set(CPACK_DEBIAN_PYTHON_PACKAGE_ARCHITECTURE all)
string(REGEX MATCH "^[0-9]+\\.[0-9]+" _kvpool_protobuf_minor "${Protobuf_VERSION}")
# The stubs come from this build's protoc: the runtime must be at least as new.
set(CPACK_DEBIAN_PYTHON_PACKAGE_DEPENDS
    "python3:any, python3-grpcio, python3-protobuf (>= ${_kvpool_protobuf_minor})")
set(CPACK_DEBIAN_PYTHON_PACKAGE_SUGGESTS "python3-numpy, kvpool")
set(CPACK_DEBIAN_PYTHON_PACKAGE_CONTROL_EXTRA
    ${_kvpool_debian}/python3-kvpool/postinst ${_kvpool_debian}/python3-kvpool/prerm)
set(CPACK_DEBIAN_PYTHON_DESCRIPTION "kvpool Python client
The kvpool package attaches to kvpoold, maps its pool (with numpy views when
python3-numpy is installed) and calls its RPCs, blocking or with asyncio.")

set(CPACK_DEBIAN_FRONTEND_PACKAGE_NAME kvpool-frontend)
set(CPACK_DEBIAN_FRONTEND_PACKAGE_SECTION net)
set(CPACK_DEBIAN_FRONTEND_PACKAGE_ARCHITECTURE all)
set(CPACK_DEBIAN_FRONTEND_PACKAGE_DEPENDS
    "python3:any, python3-kvpool (= ${PROJECT_VERSION}), python3-aiohttp, python3-prometheus-client")
set(CPACK_DEBIAN_FRONTEND_PACKAGE_RECOMMENDS "python3-sentencepiece")
set(CPACK_DEBIAN_FRONTEND_PACKAGE_CONTROL_EXTRA
    ${_kvpool_debian}/kvpool-frontend/postinst ${_kvpool_debian}/kvpool-frontend/prerm)
set(CPACK_DEBIAN_FRONTEND_DESCRIPTION "OpenAI-compatible HTTP frontend over kvpoold
kvpool-frontend serves /v1/completions and /v1/chat/completions over kvpoold's
model and prefix cache, with API keys (kvpool-frontend-keys) and per-user
limits; kvpool-http-loadgen measures it from the HTTP side.")

include(CPack)
