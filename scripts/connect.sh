#!/usr/bin/env bash
# One Kafka Connect worker, in distributed mode, with Debezium's PostgreSQL
# connector: what the Debezium tests and `millwright-bench debezium` relay
# the outbox through.
#
#   scripts/connect.sh up       fetch (once, cached), start the worker if it is
#                               down, wait until its REST API answers; print
#                               its status line on stderr and, on stdout,
#                               export MILLWRIGHT_TEST_CONNECT_URL=... for eval
#   scripts/connect.sh status   the same line and export, starting nothing
#   scripts/connect.sh down     stop the worker `up` started (by pid)
#
# Needs the broker of scripts/services.sh on 127.0.0.1:9092 (and Postgres,
# with wal_level=logical, for the connectors the tests create). The worker
# listens on 127.0.0.1:8083 (REST) only and keeps its configuration, offsets
# and status in the topics millwright-connect-{configs,offsets,status}
# (replication factor 1: the test broker is one node), group id
# millwright-connect.
#
# Jars: scripts/connect/pom.xml (connect-runtime at the broker's version) on
# the worker's classpath; scripts/connect/debezium/pom.xml (Debezium
# 3.6.1.Final) and millwright's ExpandHeaders transform
# (scripts/connect/smt) in one directory of the worker's plugin.path, so
# Debezium's dependencies load in their own class loader. Cached under
# MILLWRIGHT_SERVICES_DIR/connect-<hash of the poms and the transform>.
set -uo pipefail

# $here, $state and the helpers shared with services.sh.
# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CONNECT_PORT=8083
CONNECT_BROKERS="${MILLWRIGHT_CONNECT_BROKERS:-127.0.0.1:9092}"
# The worker's heap: one connector and its task, batches of a few thousand
# records; small beside the broker (1 GiB), the emulator (2 GiB), Postgres
# and the race-enabled tests on 2 cores / 24 GiB.
CONNECT_HEAP="${MILLWRIGHT_CONNECT_HEAP:--Xms256m -Xmx768m}"

connect_key() {
	content_key "$here/connect/pom.xml" "$here/connect/debezium/pom.xml" "$here/connect/smt/pom.xml" \
		"$here"/connect/smt/src/main/java/io/github/millwright/connect/*.java
}
connect_home() { echo "$state/connect-$(connect_key)"; }
connect_pid() { pid_from "$state/connect.pid"; }
connect_url() { echo "http://127.0.0.1:$CONNECT_PORT"; }
# Ready once the REST API answers and the Debezium plugin is loaded.
connect_ready() {
	curl -fsS -m 5 "$(connect_url)/connector-plugins" 2>/dev/null | grep -q 'io.debezium.connector.postgresql.PostgresConnector'
}

# connect_fill HOME LOG: the worker's jars, Debezium's plugin and the
# ExpandHeaders transform into HOME (emptied by `cached`).
connect_fill() {
	local home="$1" log="$2"
	mkdir -p "$home/libs" "$home/plugins/debezium-postgres" "$home/smt"
	mvn_copy "$here/connect/pom.xml" "$home/libs" "$log" connect-runtime || return 1
	mvn_copy "$here/connect/debezium/pom.xml" "$home/plugins/debezium-postgres" "$log" debezium-connector-postgres || return 1
	# Built in the cache, not in the source tree.
	cp -r "$here/connect/smt/pom.xml" "$here/connect/smt/src" "$home/smt/"
	if ! mvn -B -q -f "$home/smt/pom.xml" package >>"$log" 2>&1; then
		echo "mvn: building scripts/connect/smt (ExpandHeaders) failed (see $log)"; return 1
	fi
	cp "$home"/smt/target/millwright-connect-transforms-*.jar "$home/plugins/debezium-postgres/"
}

connect_fetch() {
	local home; home="$(connect_home)"
	[ -f "$home/.complete" ] && return 0
	need_tools "fetch Kafka Connect and Debezium" java mvn || return 1
	: >"$state/connect-fetch.log"
	cached "$home/.complete" "$home" connect_fill "$home" "$state/connect-fetch.log"
}

connect_up() {
	local why
	if ! port_open 9092 && [ "$CONNECT_BROKERS" = 127.0.0.1:9092 ]; then
		say connect "unavailable: no Kafka broker on 127.0.0.1:9092 (run scripts/services.sh up first)"; return 1
	fi
	if ! why="$(connect_fetch)"; then say connect "unavailable: $why"; return 1; fi
	local home; home="$(connect_home)"
	local how="already running"
	if ! port_open "$CONNECT_PORT"; then
		cat >"$home/worker.properties" <<-EOF
			# Written by scripts/connect.sh: one distributed-mode worker for tests.
			bootstrap.servers=$CONNECT_BROKERS
			group.id=millwright-connect
			listeners=http://127.0.0.1:$CONNECT_PORT
			rest.advertised.host.name=127.0.0.1
			rest.advertised.port=$CONNECT_PORT
			plugin.path=$home/plugins
			config.storage.topic=millwright-connect-configs
			offset.storage.topic=millwright-connect-offsets
			status.storage.topic=millwright-connect-status
			config.storage.replication.factor=1
			offset.storage.replication.factor=1
			status.storage.replication.factor=1
			offset.storage.partitions=5
			status.storage.partitions=1
			# Converters per connector (deploy/debezium/outbox-connector.json).
			key.converter=org.apache.kafka.connect.storage.StringConverter
			value.converter=org.apache.kafka.connect.converters.ByteArrayConverter
			# Offsets (the LSN Debezium confirms to Postgres) every second: the
			# switch-back procedure reads how far Debezium got.
			offset.flush.interval.ms=1000
			# A test's connector starts without waiting for a rebalance.
			scheduled.rebalance.max.delay.ms=0
			# Connectors may override their producer settings.
			connector.client.config.override.policy=All
		EOF
		: >"$state/connect.log"
		# shellcheck disable=SC2086
		start_detached "$state/connect.log" "$state/connect.pid" \
			java -cp "$home/libs/*" $CONNECT_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
			-Djava.awt.headless=true -Dlog4j2.configurationFile="$here/connect/log4j2.properties" \
			org.apache.kafka.connect.cli.ConnectDistributed "$home/worker.properties"
		touch "$state/started/connect"
		how="started"
	fi
	await connect 120 "$CONNECT_PORT" "$state/connect.pid" "$state/connect.log" \
		"REST API with the Debezium plugin" connect_ready || return 1
	say connect "$how: Kafka Connect (distributed) with Debezium on $(connect_url)"
}

connect_down() { stop_started connect "$state/connect.pid"; }

print_env() {
	connect_ready && echo "export MILLWRIGHT_TEST_CONNECT_URL='$(connect_url)'"
	return 0
}

case "${1:-}" in
up)
	take_lock 8 "$state/connect.lock" "connect: another scripts/connect.sh up" || exit 1
	connect_up; rc=$?
	print_env
	exit "$rc"
	;;
down) connect_down ;;
status)
	if connect_ready; then say connect "running: $(connect_url)"; else say connect "down"; fi
	print_env
	;;
*)
	echo "usage: $0 up|down|status" >&2
	exit 2
	;;
esac
