# Install-time half of cmake/Packaging.cmake: the files whose text names installed paths, written
# for the prefix being installed to (CMAKE_INSTALL_PREFIX when cmake_install.cmake runs: /usr for
# the Debian packages, whatever `cmake --install --prefix` says otherwise). The configuration
# directory is /etc for the prefix /usr and <prefix>/etc for any other (GNUInstallDirs' rule).
# file(INSTALL) adds $ENV{DESTDIR}, so CPack's staging tree gets them and the running system not.

function(_kvpool_sysconfdir out)
  if(CMAKE_INSTALL_PREFIX STREQUAL "/usr")
    set(${out} "/etc" PARENT_SCOPE)
  else()
    set(${out} "${CMAKE_INSTALL_PREFIX}/etc" PARENT_SCOPE)
  endif()
endfunction()

# string(REPLACE) that must find what it replaces: a renamed line in deploy/ fails the install
# instead of shipping a unit that points at /usr/local.
function(_kvpool_replace_once text_var from to)
  string(FIND "${${text_var}}" "${from}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "kvpool install: '${from}' not found (deploy/ changed?)")
  endif()
  string(REPLACE "${from}" "${to}" text "${${text_var}}")
  set(${text_var} "${text}" PARENT_SCOPE)
endfunction()

# deploy/kvpoold.service with its paths for this prefix and without its by-hand install notes,
# as <prefix>/lib/systemd/system/kvpoold.service; deploy/kvpoold.textproto as
# <sysconfdir>/kvpool/kvpoold.textproto.
function(kvpool_install_unit source_dir work_dir)
  _kvpool_sysconfdir(etc)
  set(prefix "${CMAKE_INSTALL_PREFIX}")
  file(READ "${source_dir}/deploy/kvpoold.service" unit)
  string(FIND "${unit}" "[Unit]" body)
  string(SUBSTRING "${unit}" ${body} -1 unit)
  _kvpool_replace_once(unit "/usr/local/bin/kvpoold" "${prefix}/bin/kvpoold")
  _kvpool_replace_once(unit "/etc/kvpool/kvpoold.textproto" "${etc}/kvpool/kvpoold.textproto")
  _kvpool_replace_once(unit "file:///usr/local/share/doc/kvpool/" "file://${prefix}/share/doc/kvpool/")
  file(WRITE "${work_dir}/kvpoold.service"
       "# kvpoold's systemd unit, installed by the kvpool package from deploy/kvpoold.service.\n"
       "# Local changes: `systemctl edit kvpoold` (a drop-in survives upgrades).\n${unit}")
  file(INSTALL DESTINATION "${prefix}/lib/systemd/system" TYPE FILE
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
       FILES "${work_dir}/kvpoold.service")
  file(INSTALL DESTINATION "${etc}/kvpool" TYPE FILE
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
       FILES "${source_dir}/deploy/kvpoold.textproto")
endfunction()

# <prefix>/bin/<program> running <module> from <prefix>/share/kvpool-frontend
# (deploy/debian/launcher.py.in).
function(kvpool_install_launcher source_dir work_dir program module)
  set(KVPOOL_PROGRAM "${program}")
  set(KVPOOL_LAUNCH_MODULE "${module}")
  set(KVPOOL_FRONTEND_DIR "${CMAKE_INSTALL_PREFIX}/share/kvpool-frontend")
  file(READ "${source_dir}/deploy/debian/launcher.py.in" text)
  string(CONFIGURE "${text}" text @ONLY)
  file(WRITE "${work_dir}/${program}" "${text}")
  file(INSTALL DESTINATION "${CMAKE_INSTALL_PREFIX}/bin" TYPE PROGRAM
       PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE
                   WORLD_READ WORLD_EXECUTE
       FILES "${work_dir}/${program}")
endfunction()
