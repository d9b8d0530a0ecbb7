#!/usr/bin/env bash
# Checks scripts/lib.sh's start/wait/stop, cache and lock helpers against a
# throwaway server (python3's http.server on a free loopback port) in a
# state directory of its own: no shared service is touched. Prints "ok"
# or the first check that failed (exit 1).
#
#   bash scripts/test-lib.sh
set -uo pipefail
tmp="$(mktemp -d)"
export MILLWRIGHT_SERVICES_DIR="$tmp/state"
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
fake_pid=""
trap '[ -n "$fake_pid" ] && kill "$fake_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
fail() { echo "test-lib: FAIL: $*" >&2; exit 1; }
command -v python3 >/dev/null || { echo "test-lib: skipped: needs python3" >&2; exit 0; }

port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
take_lock 9 "$state/lock" "test-lib: another test-lib" || fail "take_lock"

# Started, awaited, without the lock descriptor; a second await is at once.
start_detached "$state/fake.log" "$state/fake.pid" python3 -m http.server --bind 127.0.0.1 "$port"
fake_pid="$(cat "$state/fake.pid")"
touch "$state/started/fake"
await fake 30 "$port" "$state/fake.pid" "$state/fake.log" "an answer on $port" port_open "$port" || fail "await a started server"
[ "$(readlink "/proc/$fake_pid/fd/9" 2>/dev/null)" != "$state/lock" ] || fail "the server inherited the lock"
( exec 7>"$state/lock"; ! flock -n 7 ) || fail "the lock is not held"

# The port taken by a process with no pid file of ours.
out="$(await fake 1 "$port" "$tmp/none.pid" "$state/fake.log" "'never'" false 2>&1)" && fail "await succeeded on false"
[[ "$out" == *"127.0.0.1:$port is taken by something this script did not start"* ]] || fail "taken port: $out"
# Running but never ready.
out="$(await "cluster:node 2" 1 "$port" "$state/fake.pid" "$state/fake.log" "'never'" false 2>&1)"
[[ "$out" == *"node 2: no 'never' within 1s (see $state/fake.log)"* ]] || fail "not ready: $out"

# Stopped by pid, once; a second stop leaves it alone.
[[ "$(stop_started fake "$state/fake.pid" 2>&1)" == *stopped ]] || fail "stop_started"
pid_gone "$fake_pid" || fail "the server still runs after stop_started"
fake_pid=""
[[ "$(stop_started fake "$state/fake.pid" 2>&1)" == *"left alone" ]] || fail "second stop_started"

# A server that exits before it is ready: its log's last lines are shown.
start_detached "$state/dead.log" "$state/dead.pid" sh -c 'echo boom; exit 3'
out="$(await dead 5 "$port" "$state/dead.pid" "$state/dead.log" "'ready'" false 2>&1)"
[[ "$out" == *"exited before 'ready'"*boom* ]] || fail "exited: $out"

# The cache: filled once, marker only after success, emptied on retry.
fill() { echo x >"$1/f"; }
cached "$state/c/.complete" "$state/c" fill "$state/c" && [ -f "$state/c/.complete" ] || fail "cached fill"
cached "$state/c/.complete" "$state/c" false || fail "cached: a filled cache ran its fill again"
out="$(cached "$state/d/.complete" "$state/d" sh -c 'echo why; exit 1')" && fail "cached succeeded on a failing fill"
[ "$out" = why ] && [ ! -f "$state/d/.complete" ] || fail "cached failure: $out"
[[ "$(need_tools "do a thing" sh no-such-tool-here)" == "no-such-tool-here is not on PATH (needed to do a thing)" ]] || fail "need_tools"
[ "$(content_key "$here/lib.sh")" = "$(sha256sum "$here/lib.sh" | cut -c1-12)" ] || fail "content_key"
echo "test-lib: ok"
