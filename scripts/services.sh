#!/usr/bin/env bash
# The local services millwright's tests, benchmarks and demo run against:
# PostgreSQL and RabbitMQ from Debian's packages, a real Apache Kafka 4.x
# broker (KRaft, single node) from Maven Central jars, Google's Pub/Sub
# emulator from its Debian package, and nats-server with JetStream, built
# from its Go module.
#
#   scripts/services.sh up       install what is missing, start what is down,
#                                wait until each answers; print one status line
#                                per service on stderr and, on stdout, the
#                                MILLWRIGHT_TEST_* exports for `eval`
#   scripts/services.sh status   the same lines and exports, starting nothing
#   scripts/services.sh env      only the exports (for services that answer)
#   scripts/services.sh down     stop what `up` started (by pid), nothing else
#   scripts/services.sh restart kafka
#                                stop the broker `up` started and start it again
#                                on the same log directory (the reconnect test)
#   scripts/services.sh restart nats
#                                stop the nats-server `up` started and start it
#                                again on the same JetStream store (the
#                                reconnect test)
#   scripts/services.sh pubsub up|down
#                                the emulator alone (up prints its export)
#   scripts/services.sh pubsub threads
#                                the emulator JVM's thread count (on stdout)
#   scripts/services.sh pubsub restart-if-over N
#                                restart the emulator `up` started, on the same
#                                port, when its JVM runs more than N threads
#                                (it leaks them: see pubsub_bound);
#                                also starts it again when it died. .ci/run calls
#                                it at every stage boundary
#   scripts/services.sh pubsub restart
#                                the same, whatever its thread count
#   scripts/services.sh connect up|down|status
#                                Kafka Connect with Debezium (scripts/connect.sh),
#                                against the broker above; not part of `up`
#   scripts/services.sh up --kafka-brokers 3
#                                also a three-broker KRaft cluster on
#                                127.0.0.1:19092-19094 (the failover test)
#   scripts/services.sh cluster up|down|status|env|kill-leader TOPIC PARTITION|
#                               kill-broker N|start-broker N
#                                that cluster alone (scripts/kafka-cluster.sh)
#
#   eval "$(scripts/services.sh up)" && go test ./...
#
# Idempotent: a second `up` finds everything running and downloads nothing
# (Kafka's jars are cached under the state directory, keyed by
# scripts/kafka/pom.xml; nats-server's binary under nats-<version>, keyed
# by its module version, MILLWRIGHT_NATS_VERSION, default v2.15.3). State, logs and Kafka's log directory live in
# MILLWRIGHT_SERVICES_DIR (default ~/.cache/millwright/services).
#
# Addresses (fixed, loopback only): Postgres 127.0.0.1:5432 (trust auth for
# users postgres and root, database test), RabbitMQ 127.0.0.1:5672
# (guest/guest), Kafka 127.0.0.1:9092 (controller 127.0.0.1:9093), Pub/Sub
# emulator 127.0.0.1:8085, nats-server 127.0.0.1:4222 (MILLWRIGHT_PUBSUB_PORT moves the emulator: a second
# emulator beside the shared one, with a MILLWRIGHT_SERVICES_DIR of its own,
# as scripts/test-lib.sh starts).
set -uo pipefail

# $here, $state, say, port_open, wait_for, the lock, the Maven cache and
# the start/wait/stop helpers, shared with connect.sh and kafka-cluster.sh.
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KAFKA_PORT=9092
KAFKA_CONTROLLER_PORT=9093
PUBSUB_PORT="${MILLWRIGHT_PUBSUB_PORT:-8085}"
# The broker's heap: enough for the tests' topics and the benchmarks, small
# beside Postgres, RabbitMQ, the emulator and the race-enabled tests on
# 2 cores / 24 GiB.
KAFKA_HEAP="${MILLWRIGHT_KAFKA_HEAP:--Xms256m -Xmx1g}"
# The emulator keeps every topic, subscription and unacked message in its
# heap for as long as it runs: at 512 MiB, two hours of test runs left it
# collecting garbage and answering nothing within 10 s.
PUBSUB_HEAP="${MILLWRIGHT_PUBSUB_HEAP:--Xms256m -Xmx2g}"

# The three-broker cluster's functions (kc_*), beside the single broker.
# shellcheck source=scripts/kafka-cluster.sh
. "$here/kafka-cluster.sh"

apt_updated=""
apt_install() {
	if [ -z "$apt_updated" ]; then
		DEBIAN_FRONTEND=noninteractive apt-get update -q >"$state/apt.log" 2>&1 || return 1
		apt_updated=1
	fi
	# policy-rc.d on these machines refuses to start services at install
	# time; this script starts them itself.
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >>"$state/apt.log" 2>&1
}

# ---------------------------------------------------------------- Postgres

pg_version() { pg_lsclusters -h 2>/dev/null | awk '$2 == "main" { print $1; exit }'; }
pg_ready() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }

pg_configure() {
	local v="$1" conf="/etc/postgresql/$1/main"
	# Trust on loopback for the tests' users, first so it wins over the
	# packaged scram-sha-256 lines.
	if ! grep -q 'millwright-test' "$conf/pg_hba.conf"; then
		local tmp; tmp="$(mktemp)"
		{
			echo "# millwright-test: trust on loopback (scripts/services.sh)"
			echo "host all all 127.0.0.1/32 trust"
			echo "host all all ::1/128 trust"
			echo "local all all trust"
			cat "$conf/pg_hba.conf"
		} >"$tmp" && cat "$tmp" >"$conf/pg_hba.conf" && rm -f "$tmp"
	fi
	# Room for the test suite's pools; pg_stat_statements for the
	# benchmarks' where-does-the-time-go questions; logical decoding for
	# Debezium (scripts/connect.sh): wal_level=logical (the slots and WAL
	# senders it needs, one per connector, fit Postgres's default 10).
	mkdir -p "$conf/conf.d"
	local want
	want="$(printf '%s\n' \
		"# scripts/services.sh" \
		"listen_addresses = '127.0.0.1,::1'" \
		"max_connections = 300" \
		"shared_preload_libraries = 'pg_stat_statements'" \
		"wal_level = logical" \
		"max_replication_slots = 10" \
		"max_wal_senders = 10")"
	if [ "$(cat "$conf/conf.d/millwright.conf" 2>/dev/null)" != "$want" ]; then
		printf '%s\n' "$want" >"$conf/conf.d/millwright.conf"
		grep -q "^include_dir = 'conf.d'" "$conf/postgresql.conf" ||
			echo "include_dir = 'conf.d'" >>"$conf/postgresql.conf"
		return 10 # changed: a running server needs a restart
	fi
	return 0
}

pg_needs_restart() {
	local psql=(psql -X -h 127.0.0.1 -U postgres -d postgres -qtA)
	"${psql[@]}" -c 'SELECT pg_reload_conf()' >/dev/null 2>&1 || return 0
	sleep 1 # the postmaster applies the reload asynchronously
	[ "$("${psql[@]}" -c 'SELECT count(*) FROM pg_settings WHERE pending_restart' 2>/dev/null)" != 0 ]
}

pg_up() {
	if ! command -v pg_lsclusters >/dev/null || [ -z "$(pg_version)" ]; then
		if ! apt_install postgresql postgresql-contrib; then
			say postgres "unavailable: apt-get install postgresql failed (see $state/apt.log)"; return 1
		fi
	fi
	local v; v="$(pg_version)"
	if [ -z "$v" ]; then say postgres "unavailable: no cluster after install (pg_lsclusters)"; return 1; fi
	pg_configure "$v"; local changed=$?
	local how="already running"
	if pg_ready; then
		# A changed file restarts the server only when a setting it holds
		# needs one (wal_level, say) and the running server does not already
		# have it: reload, then ask pg_settings.pending_restart.
		if [ "$changed" = 10 ] && pg_needs_restart; then
			pg_ctlcluster --skip-systemctl-redirect "$v" main restart >>"$state/postgres.log" 2>&1 9>&-
			how="restarted (configuration changed)"
		fi
	else
		if ! pg_ctlcluster --skip-systemctl-redirect "$v" main start >>"$state/postgres.log" 2>&1 9>&-; then
			say postgres "unavailable: pg_ctlcluster $v main start failed (see $state/postgres.log and /var/log/postgresql/)"; return 1
		fi
		echo "$v" >"$state/started/postgres"
		how="started"
	fi
	if ! wait_for 60 pg_ready; then say postgres "unavailable: not answering on 127.0.0.1:5432 after 60s"; return 1; fi
	local psql=(psql -X -h 127.0.0.1 -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA)
	"${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = 'root'" | grep -q 1 ||
		"${psql[@]}" -c "CREATE ROLE root SUPERUSER LOGIN" >/dev/null
	"${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1 ||
		"${psql[@]}" -c "CREATE DATABASE test" >/dev/null
	"${psql[@]}" -d test -c "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null 2>&1 || true
	say postgres "$how: $("${psql[@]}" -c 'SHOW server_version' | cut -d' ' -f1) on 127.0.0.1:5432 (database test, users postgres and root, trust)"
}

pg_down() {
	[ -f "$state/started/postgres" ] || { say postgres "not started by this script: left alone"; return 0; }
	pg_ctlcluster --skip-systemctl-redirect "$(cat "$state/started/postgres")" main stop >>"$state/postgres.log" 2>&1
	rm -f "$state/started/postgres"
	say postgres "stopped"
}

# ---------------------------------------------------------------- RabbitMQ

rabbit_ready() { port_open 5672 && rabbitmqctl -q status >/dev/null 2>&1; }
# The node's data lives in a directory of its own that every start empties:
# the tests leave durable queues behind, and a node started on the
# packaged /var/lib/rabbitmq/mnesia after a day of test runs spent minutes
# recovering 1,024 of them (one file handle each, against su's 1,024-handle
# limit) and never answered (CI, 2026-12-01). A test broker starts empty,
# as Kafka's log directory does.
RABBIT_BASE="${MILLWRIGHT_RABBITMQ_BASE:-/var/lib/rabbitmq/millwright-test}"
rabbit_node_running() { pgrep -u rabbitmq -f 'beam.*rabbit' >/dev/null 2>&1; }
rabbit_log_tail() {
	local f
	for f in /var/log/rabbitmq/*.log; do
		[ -f "$f" ] || continue
		case "$f" in *_upgrade.log) continue ;; esac
		echo "---- last lines of $f" >&2
		tail -n 15 "$f" >&2
	done
}

rabbit_up() {
	if ! command -v rabbitmq-server >/dev/null; then
		if ! apt_install rabbitmq-server; then
			say rabbitmq "unavailable: apt-get install rabbitmq-server failed (see $state/apt.log)"; return 1
		fi
	fi
	local how="already running"
	if ! port_open 5672; then
		# A node that runs but does not answer (still booting, or stuck
		# recovering an old data directory) is given 20 s, then stopped.
		if rabbit_node_running && ! wait_for 20 port_open 5672; then
			say rabbitmq "a node runs but does not answer on 5672: stopping it"
			timeout 30 rabbitmqctl -q stop >>"$state/rabbitmq.log" 2>&1 ||
				pkill -KILL -u rabbitmq -f 'beam.*rabbit' 2>/dev/null
			wait_for 30 eval '! rabbit_node_running' || true
		fi
	fi
	if ! port_open 5672; then
		rm -rf "$RABBIT_BASE"
		install -d -o rabbitmq -g rabbitmq -m 0750 "$RABBIT_BASE"
		# Not through Debian's wrapper: it switches user with su, whose PAM
		# session lowers the open-files limit to 1,024. setpriv keeps this
		# shell's limit (raised as far as the hard limit allows).
		# -detached returns before the node is up; the wait below decides.
		(
			ulimit -S -n "$(ulimit -H -n)" 2>/dev/null
			cd /var/lib/rabbitmq &&
				exec setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups \
					env HOME=/var/lib/rabbitmq RABBITMQ_MNESIA_BASE="$RABBIT_BASE" \
					/usr/lib/rabbitmq/bin/rabbitmq-server -detached
		) >>"$state/rabbitmq.log" 2>&1 9>&-
		touch "$state/started/rabbitmq"
		how="started"
	fi
	if ! wait_for 120 rabbit_ready; then
		say rabbitmq "unavailable: not answering on 127.0.0.1:5672 after 120s (see $state/rabbitmq.log and /var/log/rabbitmq/)"
		rabbit_log_tail
		return 1
	fi
	rabbitmqctl -q await_startup >/dev/null 2>&1 || true
	say rabbitmq "$how: $(rabbitmqctl -q version 2>/dev/null || echo '?') on 127.0.0.1:5672 (guest/guest, data in $RABBIT_BASE)"
}

rabbit_down() {
	[ -f "$state/started/rabbitmq" ] || { say rabbitmq "not started by this script: left alone"; return 0; }
	rabbitmqctl -q stop >>"$state/rabbitmq.log" 2>&1
	rm -f "$state/started/rabbitmq"
	say rabbitmq "stopped"
}

# ---------------------------------------------------------------- Kafka

kafka_key() { content_key "$here/kafka/pom.xml"; }
kafka_home() { echo "$state/kafka-$(kafka_key)"; }
kafka_version() { ls "$(kafka_home)/libs" 2>/dev/null | sed -n 's/^kafka_2\.13-\(.*\)\.jar$/\1/p' | head -1; }
kafka_pid() { pid_from "$state/kafka.pid"; }
kafka_ready() { port_open "$KAFKA_PORT" && grep -q 'Kafka Server started' "$state/kafka.log" 2>/dev/null; }

# kafka_fetch: the broker's jars (scripts/kafka/pom.xml), once, into
# kafka-<key>/libs (the cluster of kafka-cluster.sh runs the same ones).
kafka_fetch() {
	local home; home="$(kafka_home)"
	[ -f "$home/libs/.complete" ] && return 0
	need_tools "fetch the broker" java mvn || return 1
	: >"$state/kafka-fetch.log"
	cached "$home/libs/.complete" "$home/libs" \
		mvn_copy "$here/kafka/pom.xml" "$home/libs" "$state/kafka-fetch.log" "the broker's jars (scripts/kafka/pom.xml)"
}

# kafka_topic_properties RF MIN_ISR PARTITIONS: the topic settings of the
# single broker and of the cluster (kafka-cluster.sh), which differ only in
# these numbers: every topic, the internal ones too, gets RF replicas and
# MIN_ISR in sync; topics are created on first use and may be deleted.
kafka_topic_properties() {
	printf '%s\n' \
		"auto.create.topics.enable=true" \
		"num.partitions=$3" \
		"default.replication.factor=$1" \
		"min.insync.replicas=$2" \
		"offsets.topic.replication.factor=$1" \
		"transaction.state.log.replication.factor=$1" \
		"transaction.state.log.min.isr=$2" \
		"share.coordinator.state.topic.replication.factor=$1" \
		"share.coordinator.state.topic.min.isr=$2" \
		"group.initial.rebalance.delay.ms=0" \
		"delete.topic.enable=true"
}

kafka_up() {
	local why
	if ! why="$(kafka_fetch)"; then say kafka "unavailable: $why"; return 1; fi
	local home; home="$(kafka_home)"
	local how="already running"
	if ! port_open "$KAFKA_PORT"; then
		mkdir -p "$home/data"
		cat >"$home/server.properties" <<-EOF
			# Written by scripts/services.sh: one KRaft node, broker and controller,
			# loopback only, settings for tests (one replica, no rebalance delay).
			process.roles=broker,controller
			node.id=1
			controller.quorum.voters=1@127.0.0.1:$KAFKA_CONTROLLER_PORT
			listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CONTROLLER_PORT
			advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
			controller.listener.names=CONTROLLER
			inter.broker.listener.name=PLAINTEXT
			listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
			log.dirs=$home/data
			# Publishing to a topic nobody created yet creates it (as kfake does);
			# the transport's subscriber creates topics with its own partition count.
			$(kafka_topic_properties 1 1 1)
			offsets.topic.num.partitions=10
			# Tests create many small topics: keep each one's files small.
			log.segment.bytes=16777216
			log.retention.hours=24
		EOF
		local java=(java -cp "$home/libs/*" -Dlog4j2.configurationFile="$here/kafka/log4j2.properties")
		# A broker started by `up` begins with an empty log directory: what
		# earlier test runs left (thousands of partitions) would only slow
		# its start and fill the disk. `restart kafka` keeps the data: the
		# reconnect test needs the messages to survive the restart.
		if [ "${1:-fresh}" = fresh ]; then
			rm -rf "$home/data"
			mkdir -p "$home/data"
		fi
		if [ ! -f "$home/data/meta.properties" ]; then
			local id
			id="$("${java[@]}" kafka.tools.StorageTool random-uuid 2>>"$state/kafka.log" | tail -1)"
			if ! "${java[@]}" kafka.tools.StorageTool format -t "$id" -c "$home/server.properties" >>"$state/kafka.log" 2>&1; then
				say kafka "unavailable: formatting the KRaft log directory failed (see $state/kafka.log)"; return 1
			fi
		fi
		: >"$state/kafka.log"
		# shellcheck disable=SC2086
		start_detached "$state/kafka.log" "$state/kafka.pid" \
			"${java[@]}" $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
			-Djava.awt.headless=true kafka.Kafka "$home/server.properties"
		touch "$state/started/kafka"
		how="started"
	fi
	await kafka 90 "$KAFKA_PORT" "$state/kafka.pid" "$state/kafka.log" "'Kafka Server started'" kafka_ready || return 1
	say kafka "$how: Apache Kafka $(kafka_version) (KRaft) on 127.0.0.1:$KAFKA_PORT"
}

kafka_down() { stop_started kafka "$state/kafka.pid"; }

# ---------------------------------------------------------------- Pub/Sub emulator

pubsub_bin() {
	local b
	for b in /usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator \
		"$(command -v cloud-pubsub-emulator 2>/dev/null)"; do
		[ -n "$b" ] && [ -x "$b" ] && { echo "$b"; return 0; }
	done
	return 1
}
pubsub_version() { dpkg-query -W -f='${Version}' google-cloud-cli-pubsub-emulator 2>/dev/null || echo '?'; }
pubsub_pid() { pid_from "$state/pubsub.pid"; }

pubsub_up() {
	local bin
	if ! bin="$(pubsub_bin)"; then
		apt_install google-cloud-cli-pubsub-emulator || true
		if ! bin="$(pubsub_bin)"; then
			say pubsub "unavailable: package google-cloud-cli-pubsub-emulator is not installed and apt-get could not install it; Pub/Sub tests fall back to pstest"
			return 1
		fi
	fi
	local how="already running"
	if ! port_open "$PUBSUB_PORT"; then
		: >"$state/pubsub.log"
		start_detached "$state/pubsub.log" "$state/pubsub.pid" \
			env JAVA_OPTS="$PUBSUB_HEAP" "$bin" --host=127.0.0.1 --port="$PUBSUB_PORT"
		touch "$state/started/pubsub"
		how="started"
	fi
	await pubsub 90 "$PUBSUB_PORT" "$state/pubsub.pid" "$state/pubsub.log" \
		"emulator answer on 127.0.0.1:$PUBSUB_PORT" port_open "$PUBSUB_PORT" || return 1
	say pubsub "$how: Google Cloud Pub/Sub emulator $(pubsub_version) on 127.0.0.1:$PUBSUB_PORT"
}

# pubsub_jvm: the pid of the emulator's JVM, when `up` started it and it
# runs. The launcher script execs java, so it is the pid `up` recorded;
# were java a child instead, it would run in the session the launcher leads.
pubsub_jvm() {
	local p; p="$(pubsub_pid)" || return 1
	if [ "$(cat "/proc/$p/comm" 2>/dev/null)" = java ]; then echo "$p"; return 0; fi
	pgrep -s "$p" -x java | head -1 | grep .
}

# pubsub_listener: the pid listening on the emulator's port, whoever
# started it (ss shows other users' processes to root only).
pubsub_listener() { ss -Hltnp "sport = :$PUBSUB_PORT" 2>/dev/null | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -1; }

# pubsub_stop: stop the emulator `up` started, its whole session (the
# launcher and java), with SIGKILL when it still runs 30 s after SIGTERM;
# true once it is gone and its port is free (at most 50 s).
pubsub_stop() {
	local p; p="$(pubsub_pid)"
	if [ -n "$p" ]; then
		kill -- "-$p" 2>/dev/null || kill "$p" 2>/dev/null
		if ! wait_for 30 pid_gone "$p"; then
			kill -KILL -- "-$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null
			wait_for 10 pid_gone "$p" || return 1
		fi
	fi
	wait_for 10 eval '! port_open "$PUBSUB_PORT"'
}

pubsub_down() {
	[ -f "$state/started/pubsub" ] || { say pubsub "not started by this script: left alone"; return 0; }
	if ! pubsub_stop; then
		say pubsub "still running 40s after SIGTERM and SIGKILL (pid $(pubsub_pid)), or 127.0.0.1:$PUBSUB_PORT still taken"; return 1
	fi
	rm -f "$state/started/pubsub" "$state/pubsub.pid"
	say pubsub "stopped"
}

# pubsub_threads: the emulator JVM's thread count on stdout (whoever
# started it); false, saying why, when there is none to read.
pubsub_threads() {
	local p n
	p="$(pubsub_jvm)" || p="$(pubsub_listener)"
	n="$([ -n "$p" ] && threads_of "$p")"
	if [ -n "$n" ]; then echo "$n"; return 0; fi
	if port_open "$PUBSUB_PORT"; then
		say pubsub "an emulator answers on 127.0.0.1:$PUBSUB_PORT but its process is not ours to read (not started by this script, and ss shows no pid)"
	else
		say pubsub "down: nothing answers on 127.0.0.1:$PUBSUB_PORT (scripts/services.sh up starts it)"
	fi
	return 1
}

# pubsub_bound BOUND: restart the emulator `up` started, on the same port,
# when its JVM runs more than BOUND threads (BOUND -1: whatever it runs),
# and start it again when it died; bounded in time (the stop takes at most
# 50 s, the start's wait on the port 90 s). Emulator 0.8.20 leaks threads
# two ways (seen with jstack on a second emulator):
#   - one per subscription until the subscription is deleted (each one's
#     MessageBacklog runs a ScheduledExecutor of its own: 50 subscriptions
#     created, 50 threads more; deleted, 50 fewer), and the tests delete
#     few of the thousands they create;
#   - one per streaming pull cancelled before its first request reached
#     the emulator, for as long as it runs: its StreamingPullPusher polls
#     every 50 ms for that request without looking at the deadline, and
#     the client's cancel dies in onRstStreamRead with a NoSuchMethodError
#     (148 of them after two runs of Watermill's suite on the googlecloud
#     kind, 4% of a core while idle). A stream that did get its request
#     ends at its deadline (googlecloud.EmulatorStreamDeadline).
# About 25 minutes of tests and killed consumers left it at 12,600 threads
# and the machine at a load average of 2,600. A restart frees them all and
# loses every topic, subscription and message: for between test runs or
# CI stages, never under running tests.
pubsub_bound() {
	local bound="$1" p n
	if [ ! -f "$state/started/pubsub" ]; then
		# Not ours: measured, never restarted.
		n="$(pubsub_threads)" || return 1
		if [ "$bound" -ge 0 ] && [ "$n" -le "$bound" ]; then
			say pubsub "$n threads (bound $bound), not started by this script: left alone"; return 0
		fi
		say pubsub "$n threads, over the bound $bound, but this script did not start the emulator on 127.0.0.1:$PUBSUB_PORT: restart it yourself (or stop it and run scripts/services.sh up)"
		return 1
	fi
	p="$(pubsub_jvm)"
	n="$([ -n "$p" ] && threads_of "$p")"
	if [ -n "$n" ] && [ "$bound" -ge 0 ] && [ "$n" -le "$bound" ] && port_open "$PUBSUB_PORT"; then
		say pubsub "$n threads (bound $bound, pid $p): left running"; return 0
	fi
	if [ -z "$n" ]; then
		say pubsub "not running (it exited; see $state/pubsub.log): starting it again on 127.0.0.1:$PUBSUB_PORT"
	elif [ "$bound" -lt 0 ]; then
		say pubsub "$n threads (pid $p): restarting it on 127.0.0.1:$PUBSUB_PORT"
	elif [ "$n" -gt "$bound" ]; then
		say pubsub "$n threads, over the bound $bound (pid $p): restarting it on 127.0.0.1:$PUBSUB_PORT"
	else
		say pubsub "$n threads (pid $p) but nothing answers on 127.0.0.1:$PUBSUB_PORT: restarting it"
	fi
	if ! pubsub_stop; then
		say pubsub "unavailable: the emulator (pid $(pubsub_pid)) still runs 40s after SIGTERM and SIGKILL, or 127.0.0.1:$PUBSUB_PORT is still taken: not restarted"
		return 1
	fi
	rm -f "$state/pubsub.pid"
	pubsub_up || return 1
	p="$(pubsub_jvm)"
	say pubsub "restarted: $(threads_of "$p") threads now (pid $p)${n:+, $n before}"
}

# ---------------------------------------------------------------- NATS

# nats-server, built from its Go module (the version below) with the Go
# toolchain into nats-<version>/bin under the state directory, once; the
# JetStream store in nats-<version>/data.
NATS_VERSION="${MILLWRIGHT_NATS_VERSION:-v2.15.3}"
NATS_PORT=4222
nats_home() { echo "$state/nats-$NATS_VERSION"; }
nats_pid() { pid_from "$state/nats.pid"; }
nats_ready() { port_open "$NATS_PORT" && grep -q 'Server is ready' "$state/nats.log" 2>/dev/null; }

# nats_build: go install github.com/nats-io/nats-server/v2@NATS_VERSION into
# nats-<version>/bin (the module cache and the build cache keep what it
# fetched and compiled).
nats_build() {
	local home; home="$(nats_home)"
	[ -x "$home/bin/nats-server" ] && [ -f "$home/bin/.complete" ] && return 0
	need_tools "build nats-server" go || return 1
	mkdir -p "$home/bin"
	if ! (cd / && GOFLAGS= GOBIN="$home/bin" go install "github.com/nats-io/nats-server/v2@$NATS_VERSION") >"$state/nats-build.log" 2>&1; then
		echo "go install github.com/nats-io/nats-server/v2@$NATS_VERSION failed (see $state/nats-build.log)"; return 1
	fi
	touch "$home/bin/.complete"
}

nats_up() {
	local why
	if ! why="$(nats_build)"; then say nats "unavailable: $why"; return 1; fi
	local home; home="$(nats_home)"
	local how="already running"
	if ! port_open "$NATS_PORT"; then
		# A server started by `up` begins with an empty store, as Kafka's
		# log directory does; `restart nats` keeps it (the reconnect test
		# needs the messages to survive the restart).
		if [ "${1:-fresh}" = fresh ]; then
			rm -rf "$home/data"
		fi
		mkdir -p "$home/data"
		: >"$state/nats.log"
		start_detached "$state/nats.log" "$state/nats.pid" \
			"$home/bin/nats-server" -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$home/data" -n millwright-test
		touch "$state/started/nats"
		how="started"
	fi
	await nats 60 "$NATS_PORT" "$state/nats.pid" "$state/nats.log" "'Server is ready'" nats_ready || return 1
	say nats "$how: nats-server $NATS_VERSION with JetStream (store $home/data) on 127.0.0.1:$NATS_PORT"
}

nats_down() { stop_started nats "$state/nats.pid"; }

# ---------------------------------------------------------------- env

print_env() {
	pg_ready && echo "export MILLWRIGHT_TEST_DATABASE_URL='postgres://postgres@127.0.0.1:5432/test?sslmode=disable'"
	port_open 5672 && echo "export MILLWRIGHT_TEST_AMQP_URL='amqp://guest:guest@127.0.0.1:5672/'"
	kafka_ready && echo "export MILLWRIGHT_TEST_KAFKA_BROKERS='127.0.0.1:$KAFKA_PORT'"
	port_open "$PUBSUB_PORT" && echo "export MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST='127.0.0.1:$PUBSUB_PORT'"
	nats_ready && echo "export MILLWRIGHT_TEST_NATS_URL='nats://127.0.0.1:$NATS_PORT'"
	# The cluster only when asked for (up --kafka-brokers 3): with its
	# variable set, the whole suite would run the failover test too.
	[ -n "${with_cluster:-}" ] && kc_env
	return 0
}

status_line() { # name description check...
	local name="$1" desc="$2"; shift 2
	if "$@"; then say "$name" "running: $desc"; else say "$name" "down"; fi
}

# One invocation at a time changes the services: an `up` that ran while
# `restart kafka` had the broker down started a second broker on a freshly
# emptied log directory under the restarting one, and both died (seen when
# a benchmark's `up` met the reconnect test's restart). The servers it
# starts do not inherit the lock (9>&- on each), or they would hold it.
# Kafka Connect has a script, state and lock of its own.
if [ "${1:-}" = connect ]; then
	shift
	exec bash "$here/connect.sh" "$@"
fi

case "${1:-} ${2:-}" in
"up "* | "down "* | "restart "* | "pubsub up" | "pubsub down" | "pubsub restart"*)
	take_lock 9 "$state/lock" "services: another scripts/services.sh up|down|restart" || exit 1
	;;
esac

case "${1:-}" in
up)
	rc=0
	case "${2:-} ${3:-}" in
	" " | "--kafka-brokers 3") ;;
	*) echo "usage: $0 up [--kafka-brokers 3] (the cluster has three brokers)" >&2; exit 2 ;;
	esac
	# Postgres and RabbitMQ first: the tests need them most, and the JVMs
	# start faster on a machine that is not also installing packages.
	pg_up || rc=1
	rabbit_up || rc=1
	kafka_up || rc=1
	pubsub_up || rc=1
	nats_up || rc=1
	if [ "${2:-}" = --kafka-brokers ]; then
		kc_main up >/dev/null || rc=1
		with_cluster=1
	fi
	print_env
	exit "$rc"
	;;
down)
	kc_main down; nats_down; pubsub_down; kafka_down; rabbit_down; pg_down
	;;
cluster)
	shift
	kc_main "$@"
	exit $?
	;;
status)
	status_line postgres "127.0.0.1:5432" pg_ready
	status_line rabbitmq "127.0.0.1:5672" port_open 5672
	status_line kafka "Apache Kafka $(kafka_version) on 127.0.0.1:$KAFKA_PORT" kafka_ready
	status_line pubsub "Pub/Sub emulator $(pubsub_version) on 127.0.0.1:$PUBSUB_PORT ($(pubsub_threads 2>/dev/null || echo '?') threads)" port_open "$PUBSUB_PORT"
	status_line nats "nats-server $NATS_VERSION (JetStream) on 127.0.0.1:$NATS_PORT" nats_ready
	[ -f "$state/started/kafka-cluster" ] && kc_status
	print_env
	;;
env)
	print_env
	;;
restart)
	case "${2:-}" in
	kafka)
		[ -f "$state/started/kafka" ] || { say kafka "not started by this script: not restarting it"; exit 1; }
		kafka_down && kafka_up keep
		;;
	pubsub) pubsub_bound -1 ;;
	nats)
		[ -f "$state/started/nats" ] || { say nats "not started by this script: not restarting it"; exit 1; }
		nats_down && nats_up keep
		;;
	*) echo "usage: $0 restart kafka|pubsub|nats" >&2; exit 2 ;;
	esac
	;;
pubsub)
	case "${2:-} ${3:-}" in
	"up ")
		pubsub_up || exit 1
		echo "export MILLWRIGHT_TEST_PUBSUB_EMULATOR_HOST='127.0.0.1:$PUBSUB_PORT'"
		;;
	"down ") pubsub_down ;;
	"threads ") pubsub_threads ;;
	"restart ") pubsub_bound -1 ;;
	"restart-if-over "[0-9]*)
		case "$3" in *[!0-9]*) echo "usage: $0 pubsub restart-if-over N (N: a number of threads)" >&2; exit 2 ;; esac
		pubsub_bound "$3"
		;;
	*) echo "usage: $0 pubsub up|down|threads|restart|restart-if-over N" >&2; exit 2 ;;
	esac
	;;
*)
	echo "usage: $0 up [--kafka-brokers 3]|down|status|env|restart kafka|pubsub|nats|pubsub up|down|threads|restart|restart-if-over N|cluster ...|connect up|down|status" >&2
	exit 2
	;;
esac
