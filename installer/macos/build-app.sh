#!/usr/bin/env bash
# Build GPU Provider for macOS: the PyInstaller .app (tray-only: LSUIElement), optionally signed
# and notarized, a .dmg to drag it to /Applications, and the self-update archive of the same app.
#
#   installer/macos/build-app.sh
#     → dist/gpu-provider-<version>-macos-<arch>.dmg
#       dist/gpu-provider-<version>-macos-<arch>.tar.gz   (sign it for the feed: docs/releasing.md)
#
# Signing and notarization run when these are set (docs/releasing.md says how to get them):
#   CODESIGN_IDENTITY  "Developer ID Application: Name (TEAMID)"
#   NOTARY_PROFILE     a `xcrun notarytool store-credentials` keychain profile
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${GPU_PROVIDER_VENV:-$ROOT/.venv}"
DIST="$ROOT/dist"
WORK="$ROOT/build"
HERE="$ROOT/installer/macos"
APP_NAME="GPU Provider"

fail() { echo "build-app: $*" >&2; exit 1; }

[ "$(uname -s)" = Darwin ] || fail "this script builds on macOS only"
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import PyInstaller, PySide6" 2>/dev/null; then
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[gui,build]"
fi
VERSION="$("$VENV/bin/python" -c 'import worker; print(worker.__version__)')"
ARCH="$(uname -m)"  # arm64 or x86_64, the feed's platform names
BASE="gpu-provider-${VERSION}-macos-${ARCH}"

(cd "$ROOT" && "$VENV/bin/pyinstaller" --noconfirm --clean --log-level WARN \
    --distpath "$DIST" --workpath "$WORK/pyinstaller" build.spec)
APP="$DIST/$APP_NAME.app"
[ -x "$APP/Contents/MacOS/gpu-provider" ] || fail "PyInstaller did not produce $APP"
[ "$(/usr/libexec/PlistBuddy -c 'Print :LSUIElement' "$APP/Contents/Info.plist")" = true ] \
    || fail "Info.plist lacks LSUIElement=true (the app would show in the Dock)"

sign_app() {
    # Inside out: every library and executable with the hardened runtime, then the bundle.
    find "$APP/Contents" -type f \( -name '*.so' -o -name '*.dylib' -o -perm -0100 \) -print0 |
        xargs -0 codesign --force --timestamp --options runtime \
            --entitlements "$HERE/entitlements.plist" --sign "$CODESIGN_IDENTITY"
    codesign --force --timestamp --options runtime --entitlements "$HERE/entitlements.plist" \
        --sign "$CODESIGN_IDENTITY" "$APP"
    codesign --verify --strict --deep --verbose=2 "$APP"
}

notarize() {
    xcrun notarytool submit "$1" --keychain-profile "$NOTARY_PROFILE" --wait
}

if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    sign_app
    if [ -n "${NOTARY_PROFILE:-}" ]; then
        ditto -c -k --keepParent "$APP" "$WORK/$BASE-app.zip"
        notarize "$WORK/$BASE-app.zip"
        xcrun stapler staple "$APP"
    fi
else
    echo "CODESIGN_IDENTITY is not set: the app is unsigned (Gatekeeper will block it on other Macs)" >&2
fi

# The dmg: the app and a link to /Applications to drag it onto.
STAGE="$WORK/dmg"
rm -rf "$STAGE" && mkdir -p "$STAGE"
ditto "$APP" "$STAGE/$APP_NAME.app"
ln -s /Applications "$STAGE/Applications"
DMG="$DIST/$BASE.dmg"
hdiutil create -volname "$APP_NAME" -srcfolder "$STAGE" -ov -format UDZO "$DMG" >&2
if [ -n "${CODESIGN_IDENTITY:-}" ]; then
    codesign --force --timestamp --sign "$CODESIGN_IDENTITY" "$DMG"
    if [ -n "${NOTARY_PROFILE:-}" ]; then
        notarize "$DMG"
        xcrun stapler staple "$DMG"
    fi
fi

# The self-update archive holds the (signed, stapled) .app itself, so an updated install keeps
# its Info.plist and signature: the updater runs "GPU Provider.app/Contents/MacOS/gpu-provider".
# Without COPYFILE_DISABLE and --no-mac-metadata, bsdtar stores extended attributes as `._*`
# AppleDouble files, which would land inside the bundle and break its seal (the updater refuses
# such an archive).
ARCHIVE="$DIST/$BASE.tar.gz"
COPYFILE_DISABLE=1 tar --no-mac-metadata -C "$DIST" -czf "$ARCHIVE" "$APP_NAME.app"
if tar -tzf "$ARCHIVE" | grep -Eq '(^|/)(\._|__MACOSX/)'; then
    fail "$ARCHIVE holds AppleDouble (._*) files: the updater would refuse it"
fi
echo "update archive: $ARCHIVE (sha256 $(shasum -a 256 "$ARCHIVE" | cut -d' ' -f1))" >&2
echo "$DMG"
