#!/usr/bin/env bash
# Makes Debian's chromium available for the operator console's browser test
# (console/browser_test.go, driven by chromedp), idempotently: a chromium
# already installed is used as it is; otherwise `apt-get install chromium`
# (headless use only; no desktop is set up). Prints an
# `export MILLWRIGHT_TEST_CHROMIUM=...` line for eval; exits 1, saying why
# on stderr, when it cannot.
set -euo pipefail
find_chromium() {
	for c in "${MILLWRIGHT_TEST_CHROMIUM:-}" chromium chromium-browser /usr/bin/chromium; do
		[ -n "$c" ] || continue
		if p="$(command -v "$c" 2>/dev/null)" && [ -x "$p" ]; then
			echo "$p"
			return 0
		fi
	done
	return 1
}
if ! p="$(find_chromium)"; then
	log="$(mktemp)"
	trap 'rm -f "$log"' EXIT
	sudo_=""
	[ "$(id -u)" = 0 ] || sudo_="sudo -n"
	{ DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -q --no-install-recommends chromium >"$log" 2>&1; } ||
		{ DEBIAN_FRONTEND=noninteractive $sudo_ apt-get update -q >>"$log" 2>&1 &&
			DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -q --no-install-recommends chromium >>"$log" 2>&1; } ||
		{ echo "chromium: apt-get install chromium failed:" >&2; tail -5 "$log" >&2; exit 1; }
	p="$(find_chromium)" || { echo "chromium: installed, but no chromium binary found on PATH" >&2; exit 1; }
fi
echo "chromium: $("$p" --version 2>/dev/null | head -1) at $p" >&2
echo "export MILLWRIGHT_TEST_CHROMIUM=$p"
