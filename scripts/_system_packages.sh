# Sourced by scripts/test (and through it .ci/run): the Debian packages the tests need, installed
# where this user can (root, or sudo without a password); otherwise it stops at once with the one
# command to run. Not a Debian system (no dpkg): nothing is checked, the tests say what is missing.
#
# Qt's runtime libraries (even offscreen: fonts, EGL/GL, xkbcommon, dbus); the compiler and CMake
# that build llama-server; the real X desktop tests/desktop/ runs the app on (Xvfb, a window
# manager, an XEmbed tray host, the X tools that look and click, Qt's xcb libraries).
SYSTEM_PACKAGES=(libegl1 libgl1 libxkbcommon0 libfontconfig1 libdbus-1-3 fonts-dejavu-core cmake g++
                 xvfb openbox trayer xdotool x11-utils
                 libx11-xcb1 libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0
                 libxcb-render-util0 libxcb-shape0 libxcb-xkb1 libxkbcommon-x11-0)

install_system_packages() {
    command -v dpkg >/dev/null 2>&1 || return 0
    local need=() pkg
    for pkg in "${SYSTEM_PACKAGES[@]}"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    [ "${#need[@]}" -eq 0 ] && return 0
    local as=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            as=(sudo -n)
        else
            echo "the tests need these system packages; install them, then run this again:" >&2
            echo "  sudo apt-get install -y ${need[*]}" >&2
            exit 1
        fi
    fi
    echo "installing system packages the tests need: ${need[*]}" >&2
    "${as[@]}" apt-get update -qq >&2
    "${as[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
}
