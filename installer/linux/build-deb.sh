#!/usr/bin/env bash
# Build the Linux package: PyInstaller one-folder build (build.spec), laid out as a .deb, plus the
# self-update archive of the same build. Run from anywhere; CI runs it as is.
#
#   installer/linux/build-deb.sh            → dist/gpu-provider_<version>_<arch>.deb
#                                             dist/gpu-provider-<version>-linux-<arch>.tar.gz
# Environment: GPU_PROVIDER_VENV (default .venv), PYTHON (to create it, default python3),
# DEB_COMPRESSION (gzip, xz or zstd; default gzip).
set -euo pipefail
umask 022

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${GPU_PROVIDER_VENV:-$ROOT/.venv}"
DIST="$ROOT/dist"
WORK="$ROOT/build"

fail() { echo "build-deb: $*" >&2; exit 1; }

command -v dpkg-deb >/dev/null || fail "dpkg-deb is missing: apt-get install dpkg"
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import PyInstaller, PySide6" 2>/dev/null; then
    echo "installing the build tools into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[gui,build]"
fi

VERSION="$("$VENV/bin/python" -c 'import worker; print(worker.__version__)')"
DEB_ARCH="$(dpkg --print-architecture)"
case "$(uname -m)" in
    x86_64 | amd64) FEED_ARCH=x86_64 ;;
    aarch64 | arm64) FEED_ARCH=arm64 ;;
    *) FEED_ARCH="$(uname -m)" ;;
esac

echo "building gpu-provider $VERSION with PyInstaller" >&2
started=$SECONDS
(cd "$ROOT" && "$VENV/bin/pyinstaller" --noconfirm --clean --log-level WARN \
    --distpath "$DIST" --workpath "$WORK/pyinstaller" build.spec)
BUNDLE="$DIST/gpu-provider"
[ -x "$BUNDLE/gpu-provider" ] || fail "PyInstaller did not produce $BUNDLE/gpu-provider"

PKG="$WORK/deb/gpu-provider_${VERSION}_${DEB_ARCH}"
rm -rf "$PKG"
mkdir -p "$PKG/DEBIAN" "$PKG/opt" "$PKG/usr/bin" "$PKG/usr/share/applications" \
    "$PKG/usr/share/icons/hicolor/512x512/apps" "$PKG/usr/share/icons/hicolor/scalable/apps"
cp -a "$BUNDLE" "$PKG/opt/gpu-provider"

# A wrapper rather than a symlink: the bundle finds its libraries next to the real executable.
cat > "$PKG/usr/bin/gpu-provider" <<'WRAPPER'
#!/bin/sh
exec /opt/gpu-provider/gpu-provider "$@"
WRAPPER
chmod 0755 "$PKG/usr/bin/gpu-provider"
install -m 0644 "$ROOT/installer/linux/gpu-provider.desktop" "$PKG/usr/share/applications/gpu-provider.desktop"
install -m 0644 "$ROOT/assets/icon.png" "$PKG/usr/share/icons/hicolor/512x512/apps/gpu-provider.png"
install -m 0644 "$ROOT/assets/icon.svg" "$PKG/usr/share/icons/hicolor/scalable/apps/gpu-provider.svg"

INSTALLED_KIB="$(du -sk --exclude=DEBIAN "$PKG" | cut -f1)"
cat > "$PKG/DEBIAN/control" <<CONTROL
Package: gpu-provider
Version: $VERSION
Architecture: $DEB_ARCH
Maintainer: gpu-provider maintainers <maintainers@gpu-provider.invalid>
Installed-Size: $INSTALLED_KIB
Section: utils
Priority: optional
Depends: libc6, libgl1, libegl1, libfontconfig1, libfreetype6, libdbus-1-3, libxkbcommon0,
 libxkbcommon-x11-0, libxcb-cursor0, libxcb-icccm4, libxcb-keysyms1
Recommends: libgtk-3-0
Suggests: gnome-shell-extension-appindicator
Description: lend this computer's GPUs to an inference network
 A system tray app over a headless core that detects the machine, plans and
 supervises vLLM / llama.cpp engines, relays requests from a coordinator and
 measures what it serves. Updates itself with signed releases.
CONTROL
for script in postinst postrm; do
    install -m 0755 "$ROOT/installer/linux/$script" "$PKG/DEBIAN/$script"
done

DEB="$DIST/gpu-provider_${VERSION}_${DEB_ARCH}.deb"
# gzip: every dpkg reads it, and it compresses a 270 MB bundle several times faster than xz.
dpkg-deb --build --root-owner-group -Z"${DEB_COMPRESSION:-gzip}" "$PKG" "$DEB" >&2

# The same build as a self-update archive (docs/releasing.md: sign it, list it in the feed).
ARCHIVE="$DIST/gpu-provider-${VERSION}-linux-${FEED_ARCH}.tar.gz"
tar -C "$DIST" -czf "$ARCHIVE" gpu-provider

echo "built in $((SECONDS - started)) s" >&2
echo "update archive: $ARCHIVE (sha256 $(sha256sum "$ARCHIVE" | cut -d' ' -f1))" >&2
echo "$DEB"
