#!/usr/bin/env bash
# Checks scripts/lib.sh's start/wait/stop, cache and lock helpers against a
# throwaway server (python3's http.server on a free loopback port) in a
# state directory of its own, then, where Google's Pub/Sub emulator is
# installed, scripts/services.sh's thread bound on a second emulator of its
# own (another port, that state directory): no shared service is touched.
# Prints "ok" or the first check that failed (exit 1).
#
#   bash scripts/test-lib.sh
set -uo pipefail
tmp="$(mktemp -d)"
export MILLWRIGHT_SERVICES_DIR="$tmp/state"
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
fake_pid=""
emulator=""
trap '[ -n "$fake_pid" ] && kill "$fake_pid" 2>/dev/null; [ -n "$emulator" ] && bash "$here/services.sh" pubsub down >/dev/null 2>&1; rm -rf "$tmp"' EXIT
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
n="$(threads_of "$fake_pid")"
[[ "$n" =~ ^[1-9][0-9]*$ ]] || fail "threads_of a running server: '$n'"
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
[ -z "$(threads_of "$fake_pid")" ] || fail "threads_of a stopped server is not empty"
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

# The emulator's thread bound (services.sh pubsub restart-if-over), on an
# emulator of this test's own: started, grown by subscriptions (one thread
# each on emulator 0.8.20), left alone under the bound, restarted over it
# (a new JVM on the same port that answers, its threads back down), and
# started again after it died. Three JVM starts, a few seconds each.
exec 9>&- # services.sh takes the state directory's lock itself
services() { bash "$here/services.sh" "$@"; }
emu_pid() { cat "$state/pubsub.pid" 2>/dev/null; }
if [ ! -x /usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator ] && ! command -v cloud-pubsub-emulator >/dev/null; then
	echo "test-lib: the emulator's thread bound skipped: google-cloud-cli-pubsub-emulator is not installed" >&2
elif ! command -v curl >/dev/null; then
	echo "test-lib: the emulator's thread bound skipped: needs curl" >&2
else
	MILLWRIGHT_PUBSUB_PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
	export MILLWRIGHT_PUBSUB_PORT
	api="http://127.0.0.1:$MILLWRIGHT_PUBSUB_PORT/v1/projects/test-lib"
	answers() { [ "$(curl -s -o /dev/null -w '%{http_code}' -m 10 -X PUT "$api/topics/topic-$1")" = 200 ]; }
	emulator=1
	out="$(services pubsub up 2>&1)" || fail "pubsub up: $out"
	first="$(emu_pid)"
	wait_for 60 answers 0 || fail "the emulator does not create a topic on $MILLWRIGHT_PUBSUB_PORT"
	base="$(services pubsub threads)" || fail "pubsub threads"
	for i in $(seq 1 40); do
		curl -s -o /dev/null -m 10 -X PUT -H 'content-type: application/json' \
			-d "{\"topic\": \"projects/test-lib/topics/topic-0\"}" "$api/subscriptions/sub-$i"
	done
	grown="$(services pubsub threads)"
	[ "$grown" -ge $((base + 40)) ] || fail "40 subscriptions took the emulator from $base to $grown threads, not 40 more"
	bound=$((base + 20))
	out="$(services pubsub restart-if-over "$bound" 2>&1)" || fail "restart-if-over $bound: $out"
	[[ "$out" == *"$grown threads, over the bound $bound"*"restarted: "* ]] || fail "restart-if-over $bound over it: $out"
	second="$(emu_pid)"
	[ -n "$second" ] && [ "$second" != "$first" ] && pid_gone "$first" || fail "not a new emulator after the restart (pid $first, then $second)"
	answers 1 || fail "the restarted emulator does not answer on $MILLWRIGHT_PUBSUB_PORT"
	now="$(services pubsub threads)"
	[ "$now" -le "$bound" ] || fail "$now threads after the restart, over the bound $bound"
	out="$(services pubsub restart-if-over "$bound" 2>&1)" || fail "restart-if-over $bound under it: $out"
	[[ "$out" == *"(bound $bound, pid $second): left running" ]] && [ "$(emu_pid)" = "$second" ] || fail "restart-if-over under the bound: $out"
	kill -KILL "$second"
	wait_for 10 pid_gone "$second" || fail "SIGKILL"
	out="$(services pubsub restart-if-over "$bound" 2>&1)" || fail "restart-if-over after the emulator died: $out"
	[[ "$out" == *"not running (it exited"*"restarted: "* ]] && answers 2 || fail "not started again after it died: $out"
	# A restart that cannot happen fails, saying why: the emulator died
	# and something else took its port.
	third="$(emu_pid)"
	kill -KILL "$third"
	wait_for 10 pid_gone "$third" && wait_for 10 eval '! port_open "$MILLWRIGHT_PUBSUB_PORT"' || fail "SIGKILL"
	start_detached "$state/squatter.log" "$state/squatter.pid" python3 -m http.server --bind 127.0.0.1 "$MILLWRIGHT_PUBSUB_PORT"
	fake_pid="$(cat "$state/squatter.pid")"
	wait_for 30 port_open "$MILLWRIGHT_PUBSUB_PORT" || fail "the squatter does not answer"
	out="$(services pubsub restart-if-over "$bound" 2>&1)" && fail "restart-if-over succeeded with its port taken: $out"
	[[ "$out" == *"127.0.0.1:$MILLWRIGHT_PUBSUB_PORT is still taken: not restarted"* ]] || fail "restart-if-over with its port taken: $out"
	kill "$fake_pid"
	wait_for 10 pid_gone "$fake_pid" || fail "stopping the squatter"
	fake_pid=""
	out="$(services pubsub restart-if-over nine 2>&1)" && fail "restart-if-over took a bound that is not a number"
	out="$(services pubsub down 2>&1)" && ! port_open "$MILLWRIGHT_PUBSUB_PORT" || fail "pubsub down: $out"
	emulator=""
fi
echo "test-lib: ok"
