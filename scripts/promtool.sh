#!/usr/bin/env bash
# Makes Prometheus's promtool available for the tests that check the
# framework's /metrics output and alert rules with it (internal/testing/metricscheck),
# idempotently and cached: promtool on PATH is used as it is; otherwise the
# binary is taken out of Debian's `prometheus` package (downloaded, not
# installed: no Prometheus server is set up or started) into a cache
# directory. Prints an `export PATH=...` line for eval; exits 1, saying why
# on stderr, when it cannot.
set -euo pipefail
if p="$(command -v promtool 2>/dev/null)"; then
	echo "promtool: $("$p" --version 2>&1 | head -1) at $p" >&2
	exit 0
fi
cache="${MILLWRIGHT_SERVICES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/millwright/services}/promtool"
if [ ! -x "$cache/usr/bin/promtool" ]; then
	tmp="$(mktemp -d)"
	trap 'rm -rf "$tmp"' EXIT
	(cd "$tmp" && apt-get download prometheus >"$tmp/apt.log" 2>&1) ||
		{ DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$tmp/apt.log" 2>&1 && (cd "$tmp" && apt-get download prometheus >>"$tmp/apt.log" 2>&1); } ||
		{ echo "promtool: apt-get download prometheus failed:" >&2; tail -5 "$tmp/apt.log" >&2; exit 1; }
	mkdir -p "$cache"
	dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
	mkdir -p "$cache/usr/bin"
	cp "$tmp/x/usr/bin/promtool" "$cache/usr/bin/promtool"
fi
echo "promtool: $("$cache/usr/bin/promtool" --version 2>&1 | head -1) at $cache/usr/bin/promtool (from Debian's prometheus package)" >&2
echo "export PATH=\"\$PATH:$cache/usr/bin\""
