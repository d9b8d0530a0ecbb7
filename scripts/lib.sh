# shellcheck shell=bash
# What scripts/services.sh, scripts/connect.sh and scripts/kafka-cluster.sh
# share: the state directory, status lines, bounded waits, the lock each
# changing verb takes, the Maven fetch into a cache directory, and starting
# a server detached, waiting for it and stopping it by pid. Sourced, never
# run; sourcing it twice is harmless.
#
# Sets $here (this folder) and $state (MILLWRIGHT_SERVICES_DIR, default
# ~/.cache/millwright/services, with started/ under it: one marker file per
# server a script started, which is what `down` may stop).

[ -n "${millwright_lib_sourced:-}" ] && return 0
millwright_lib_sourced=1

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
state="${MILLWRIGHT_SERVICES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/millwright/services}"
mkdir -p "$state/started"

# say NAME MESSAGE: one status line on stderr (stdout carries the exports).
say() { printf '%-10s %s\n' "$1" "$2" >&2; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_for SECONDS COMMAND...: true once COMMAND succeeds, false after SECONDS.
wait_for() {
	local deadline=$((SECONDS + $1)); shift
	until "$@"; do
		[ "$SECONDS" -ge "$deadline" ] && return 1
		sleep 0.5
	done
}

# take_lock FD FILE WHO: hold FILE's lock on descriptor FD (8 or 9) for the
# rest of the script, waiting at most 5 minutes; WHO ("services: another
# scripts/services.sh up") names who else holds it when it gives up. The
# servers started under it must not inherit the descriptor
# (start_detached closes 8 and 9).
take_lock() {
	local fd="$1" file="$2" who="$3"
	mkdir -p "$(dirname "$file")"
	eval "exec $fd>\"\$file\""
	flock -w 300 "$fd" && return 0
	echo "$who has held $file for 5 minutes; giving up" >&2
	return 1
}

# content_key FILE...: 12 hex digits of the files' contents, which name a
# cache directory (changing a pom fetches again, into a new directory).
content_key() { cat "$@" | sha256sum | cut -c1-12; }

# need_tools WHAT TOOL...: say (on stdout, for the caller's status line)
# which tool is missing to do WHAT.
need_tools() {
	local what="$1" t; shift
	for t in "$@"; do
		command -v "$t" >/dev/null || { echo "$t is not on PATH (needed to $what)"; return 1; }
	done
}

# cached MARKER DIR FILL...: nothing when MARKER exists; otherwise DIR is
# emptied, FILL runs (it says why on stdout when it fails) and MARKER is
# written once it succeeded, so that an interrupted fetch starts over.
cached() {
	local marker="$1" dir="$2"; shift 2
	[ -f "$marker" ] && return 0
	rm -rf "$dir"
	mkdir -p "$dir"
	"$@" || return 1
	touch "$marker"
}

# mvn_copy POM DIR LOG WHAT: POM's runtime dependencies into DIR (Maven's
# own cache in ~/.m2 keeps what it downloaded), output appended to LOG.
mvn_copy() {
	mvn -B -q -f "$1" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$2" >>"$3" 2>&1 ||
		{ echo "mvn: fetching $4 failed (see $3)"; return 1; }
}

# pid_from FILE: the pid FILE holds, when that process runs.
pid_from() { local p; p="$(cat "$1" 2>/dev/null)" && [ -n "$p" ] && kill -0 "$p" 2>/dev/null && echo "$p"; }
pid_gone() { ! kill -0 "$1" 2>/dev/null; }
# threads_of PID: how many threads PID runs (Threads: in /proc/PID/status),
# or nothing when it does not run.
threads_of() { awk '/^Threads:/ { print $2 }' "/proc/$1/status" 2>/dev/null; }

# start_detached LOG PIDFILE COMMAND...: COMMAND in a session of its own
# (setsid: it outlives this shell and `down` stops it by pid), output
# appended to LOG, without the lock descriptors 8 and 9 (or it would hold
# the lock); returns at once.
start_detached() {
	local log="$1" pidfile="$2"; shift 2
	setsid nohup "$@" >>"$log" 2>&1 </dev/null 8>&- 9>&- &
	echo $! >"$pidfile"
}

# await NAME SECONDS PORT PIDFILE LOG WHAT READY...: wait until READY
# succeeds; when it does not within SECONDS, say why: the port is taken by
# a process this script did not start, the server exited (with the last
# lines of LOG), or it runs without WHAT (the readiness sign) in time.
# NAME may carry a label after a colon ("cluster:node 2") for the line.
await() {
	local name="${1%%:*}" label="" secs="$2" port="$3" pidfile="$4" log="$5" what="$6"
	[ "$1" != "$name" ] && label="${1#*:}: "
	shift 6
	wait_for "$secs" "$@" && return 0
	if [ -n "$(pid_from "$pidfile")" ]; then
		say "$name" "unavailable: ${label}no $what within ${secs}s (see $log)"
	elif port_open "$port"; then
		say "$name" "unavailable: ${label}127.0.0.1:$port is taken by something this script did not start"
	else
		say "$name" "unavailable: ${label}exited before $what (see $log); its last lines:"
		tail -n 20 "$log" >&2
	fi
	return 1
}

# stop_pid PID [SIGNAL]: SIGNAL (TERM) to PID, SIGKILL when it still runs
# 30 s later; true once it is gone (at most 10 s after the SIGKILL).
stop_pid() {
	local p="$1"
	kill "-${2:-TERM}" "$p" 2>/dev/null
	wait_for 30 pid_gone "$p" || kill -KILL "$p" 2>/dev/null
	wait_for 10 pid_gone "$p"
}

# stop_started NAME PIDFILE: stop the server NAME only if a script of ours
# started it (its marker in $state/started), by the pid in PIDFILE.
stop_started() {
	local name="$1" pidfile="$2" p
	[ -f "$state/started/$name" ] || { say "$name" "not started by this script: left alone"; return 0; }
	p="$(pid_from "$pidfile")"
	[ -n "$p" ] && stop_pid "$p"
	rm -f "$state/started/$name" "$pidfile"
	say "$name" "stopped"
}
