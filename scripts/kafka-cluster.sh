# shellcheck shell=bash
# A three-broker Apache Kafka cluster (KRaft) for the failover tests,
# beside the shared single broker on 9092 and never touching it. Sourced
# by scripts/services.sh, which provides kafka_fetch, kafka_home and
# kafka_topic_properties (the cluster runs the same cached jars as the
# single broker: scripts/kafka/pom.xml); $here, $state and the
# start/wait/stop helpers come from scripts/lib.sh.
#
#   scripts/services.sh cluster up             start the three nodes (fresh logs)
#   scripts/services.sh up --kafka-brokers 3   the shared services, then the cluster
#   scripts/services.sh cluster down           stop the three nodes (by pid)
#   scripts/services.sh cluster status         one line per node, and the export
#   scripts/services.sh cluster env            only the export
#   scripts/services.sh cluster kill-leader TOPIC PARTITION
#                                              SIGKILL the node leading TOPIC/PARTITION;
#                                              prints "killed broker N pid P at MS leader of T/P"
#   scripts/services.sh cluster kill-broker N  SIGKILL node N
#   scripts/services.sh cluster start-broker N start node N again on its log directory
#
# Layout: three combined nodes (process.roles=broker,controller), node N
# serving clients on 127.0.0.1:1909(1+N) (19092, 19093, 19094) and the
# controller quorum on 127.0.0.1:1919(1+N). Three combined nodes and not
# dedicated controllers: on 2 cores, three controllers beside three
# brokers would be six JVMs; one dedicated controller would be four, and a
# single point the tests must never kill. Three combined voters survive the
# loss of any one node, which is what kill-leader does, including the
# active controller when it is also the partition's leader.
#
# State: $state/kafka-cluster/node-N/{server.properties,data,kafka.log,pid}.
# `cluster up` formats fresh log directories when no node runs (like the
# single broker's `up`); `start-broker N` keeps node N's data, as a broker
# that crashed and restarts does.
#
# Heaps: -Xms128m -Xmx512m per node (MILLWRIGHT_KAFKA_CLUSTER_HEAP). The
# failover test moves 100,000 events of a few hundred bytes: the page
# cache holds the logs, not the heap; 512 MiB leaves headroom for
# replica fetchers and the metadata image. Three nodes at most 1.5 GiB of
# heap (about 2.5 GiB resident with metaspace and buffers) fit beside
# Postgres, RabbitMQ, the emulator (2 GiB) and the single broker (1 GiB)
# in 24 GiB. CPU is what is scarce on 2 cores: each node runs 2 network
# and 2 I/O threads (defaults 3 and 8), and no JMX.

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KCLUSTER_NODES=3
KCLUSTER_CLIENT_BASE=19091     # node N: 19091+N
KCLUSTER_CONTROLLER_BASE=19191 # node N: 19191+N
KCLUSTER_HEAP="${MILLWRIGHT_KAFKA_CLUSTER_HEAP:--Xms128m -Xmx512m}"

kc_dir() { echo "$state/kafka-cluster"; }
kc_node() { echo "$(kc_dir)/node-$1"; }
kc_port() { echo $((KCLUSTER_CLIENT_BASE + $1)); }
kc_cport() { echo $((KCLUSTER_CONTROLLER_BASE + $1)); }
kc_pid() { pid_from "$(kc_node "$1")/pid"; }
kc_ready() { port_open "$(kc_port "$1")" && grep -q 'Kafka Server started' "$(kc_node "$1")/kafka.log" 2>/dev/null; }
kc_nodes() { seq 1 "$KCLUSTER_NODES"; }
kc_brokers() {
	local n out=""
	for n in $(kc_nodes); do out="${out:+$out,}127.0.0.1:$(kc_port "$n")"; done
	echo "$out"
}
kc_java() { echo java -cp "$(kafka_home)/libs/*" -Dlog4j2.configurationFile="$here/kafka/log4j2.properties"; }

kc_properties() { # N
	local n="$1" voters="" i
	for i in $(kc_nodes); do voters="${voters:+$voters,}$i@127.0.0.1:$(kc_cport "$i")"; done
	cat <<-EOF
		# Written by scripts/kafka-cluster.sh: node $n of a three-node KRaft
		# cluster (broker and controller in each), loopback only.
		process.roles=broker,controller
		node.id=$n
		controller.quorum.voters=$voters
		listeners=PLAINTEXT://127.0.0.1:$(kc_port "$n"),CONTROLLER://127.0.0.1:$(kc_cport "$n")
		advertised.listeners=PLAINTEXT://127.0.0.1:$(kc_port "$n")
		controller.listener.names=CONTROLLER
		inter.broker.listener.name=PLAINTEXT
		listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
		log.dirs=$(kc_node "$n")/data
		# Topics as a production cluster should have them: three replicas,
		# a write acknowledged by acks=all is on at least two, and an
		# out-of-sync replica never becomes leader (it would drop what the
		# others acknowledged).
		$(kafka_topic_properties 3 2 6)
		unclean.leader.election.enable=false
		offsets.topic.num.partitions=6
		# A SIGKILLed node stops heartbeating; the active controller fences
		# it, and moves its leaderships, after broker.session.timeout.ms
		# (default 9 s). 3 s keeps the failover test's stalls short; a GC
		# pause on the loaded 2-core machine stays well under it.
		broker.heartbeat.interval.ms=500
		broker.session.timeout.ms=3000
		num.network.threads=2
		num.io.threads=2
		num.recovery.threads.per.data.dir=1
		log.segment.bytes=16777216
		log.retention.hours=24
	EOF
}

# kc_format: fresh log directories for every node, one cluster id.
kc_format() {
	local java id n
	read -ra java <<<"$(kc_java)"
	mkdir -p "$(kc_dir)"
	if ! id="$("${java[@]}" kafka.tools.StorageTool random-uuid 2>>"$(kc_dir)/format.log" | tail -1)" || [ -z "$id" ]; then
		echo "kafka.tools.StorageTool random-uuid failed (see $(kc_dir)/format.log)"; return 1
	fi
	# The three formats at once: each is a JVM start, 10 s or more on a
	# loaded 2-core machine.
	local pids=() failed=""
	for n in $(kc_nodes); do
		local d; d="$(kc_node "$n")"
		rm -rf "$d/data"
		mkdir -p "$d/data"
		kc_properties "$n" >"$d/server.properties"
		"${java[@]}" kafka.tools.StorageTool format -t "$id" -c "$d/server.properties" >"$d/format.log" 2>&1 &
		pids+=("$!")
	done
	for n in $(kc_nodes); do
		wait "${pids[$((n - 1))]}" || failed="$failed $n"
	done
	if [ -n "$failed" ]; then
		echo "formatting the log directory of node(s)$failed failed (see $(kc_dir)/node-N/format.log)"; return 1
	fi
}

# kc_start N: start node N on its (formatted) log directory; returns at once.
kc_start() {
	local n="$1" d java
	d="$(kc_node "$n")"
	read -ra java <<<"$(kc_java)"
	[ -f "$d/kafka.log" ] && mv -f "$d/kafka.log" "$d/kafka.log.1"
	: >"$d/kafka.log"
	# shellcheck disable=SC2086
	start_detached "$d/kafka.log" "$d/pid" \
		"${java[@]}" $KCLUSTER_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
		-Djava.awt.headless=true kafka.Kafka "$d/server.properties"
}

kc_wait() { # N SECONDS
	local n="$1" d; d="$(kc_node "$1")"
	await "cluster:node $n" "$2" "$(kc_port "$n")" "$d/pid" "$d/kafka.log" "'Kafka Server started'" kc_ready "$n"
}

kc_up() {
	local why n running=0
	if ! why="$(kafka_fetch)"; then say cluster "unavailable: $why"; return 1; fi
	for n in $(kc_nodes); do [ -n "$(kc_pid "$n")" ] && running=$((running + 1)); done
	for n in $(kc_nodes); do
		if [ -z "$(kc_pid "$n")" ] && port_open "$(kc_port "$n")"; then
			say cluster "unavailable: 127.0.0.1:$(kc_port "$n") is taken by something this script did not start"; return 1
		fi
	done
	local how="already running"
	if [ "$running" = 0 ]; then
		# No node runs: start from empty logs, as the single broker's `up`
		# does (earlier runs' topics would only slow the start).
		if ! why="$(kc_format)"; then say cluster "unavailable: $why"; return 1; fi
		for n in $(kc_nodes); do kc_start "$n"; done
		how="started"
	elif [ "$running" -lt "$KCLUSTER_NODES" ]; then
		for n in $(kc_nodes); do [ -z "$(kc_pid "$n")" ] && kc_start "$n"; done
		how="restarted the nodes that were down"
	fi
	touch "$state/started/kafka-cluster"
	kc_leader_tool >/dev/null || say cluster "warning: kill-leader's helper did not build (above); kill-leader will try again"
	# Three JVMs starting at once on 2 cores, and each waits for a quorum.
	for n in $(kc_nodes); do kc_wait "$n" 180 || return 1; done
	say cluster "$how: Apache Kafka $(kafka_version) (KRaft, $KCLUSTER_NODES combined nodes) on $(kc_brokers) (RF 3, min.insync.replicas=2; state in $(kc_dir))"
}

kc_stop() { # N SIGNAL
	local p; p="$(kc_pid "$1")"
	[ -z "$p" ] && return 0
	stop_pid "$p" "$2"
}

kc_down() {
	[ -f "$state/started/kafka-cluster" ] || { say cluster "not started by this script: left alone"; return 0; }
	local n p
	# All at once: a node stopping alone waits to hand its leaderships over.
	for n in $(kc_nodes); do p="$(kc_pid "$n")" && kill "$p" 2>/dev/null; done
	for n in $(kc_nodes); do kc_stop "$n" TERM; rm -f "$(kc_node "$n")/pid"; done
	rm -f "$state/started/kafka-cluster"
	say cluster "stopped"
}

kc_check_node() { # N
	case "$1" in
	[1-9]) [ "$1" -le "$KCLUSTER_NODES" ] && return 0 ;;
	esac
	echo "cluster: node \"$1\": want 1 to $KCLUSTER_NODES" >&2
	return 2
}

kc_kill() { # N [WHAT]
	local n="$1" p
	kc_check_node "$n" || return 2
	p="$(kc_pid "$n")"
	if [ -z "$p" ]; then say cluster "node $n is not running (see $(kc_node "$n")/kafka.log)"; return 1; fi
	local at; at="$(date +%s%3N)"
	kill -KILL "$p"
	if ! wait_for 10 pid_gone "$p"; then
		say cluster "node $n (pid $p) still runs 10s after SIGKILL"; return 1
	fi
	echo "killed broker $n pid $p at $at${2:+ $2}"
}

# kc_leader_tool: the leader helper's binary, built by `cluster up` so
# that kill-leader does not compile on the spot (seconds on a loaded
# machine, while the test waits to kill mid-batch); rebuilt when its
# source is newer.
kc_leader_tool() {
	local bin src
	bin="$(kc_dir)/kafkaleader" src="$here/../internal/testing/kafkaleader/main.go"
	if [ ! -x "$bin" ] || [ "$src" -nt "$bin" ]; then
		(cd "$here/.." && go build -o "$bin" ./internal/testing/kafkaleader) >&2 || return 1
	fi
	echo "$bin"
}

kc_kill_leader() { # TOPIC PARTITION
	local topic="$1" part="$2" out tool
	if [ -z "$topic" ] || [ -z "$part" ]; then echo "usage: $0 cluster kill-leader TOPIC PARTITION" >&2; return 2; fi
	if ! tool="$(kc_leader_tool)"; then say cluster "building internal/testing/kafkaleader failed (above)"; return 1; fi
	if ! out="$("$tool" -brokers "$(kc_brokers)" -topic "$topic" -partition "$part")"; then
		say cluster "could not find the leader of $topic/$part (above)"; return 1
	fi
	kc_kill "${out%% *}" "leader of $topic/$part (isr ${out#* })"
}

kc_start_broker() { # N
	local n="$1"
	kc_check_node "$n" || return 2
	[ -f "$(kc_node "$n")/server.properties" ] || { say cluster "node $n was never formatted: run cluster up"; return 1; }
	if [ -n "$(kc_pid "$n")" ]; then say cluster "node $n already running (pid $(kc_pid "$n"))"; return 0; fi
	kc_start "$n"
	kc_wait "$n" 120 || return 1
	say cluster "node $n started again (pid $(kc_pid "$n")) on 127.0.0.1:$(kc_port "$n")"
}

kc_env() {
	local n
	for n in $(kc_nodes); do kc_ready "$n" || return 0; done
	echo "export MILLWRIGHT_TEST_KAFKA_CLUSTER='$(kc_brokers)'"
}

kc_status() {
	local n
	for n in $(kc_nodes); do
		if kc_ready "$n"; then
			say cluster "node $n running: pid $(kc_pid "$n") on 127.0.0.1:$(kc_port "$n")"
		else
			say cluster "node $n down"
		fi
	done
	kc_env
}

# kc_main VERB ARGS...: the `cluster` verbs, each under the cluster's own
# lock (not the shared services' lock: a failover test restarting a node
# must not wait for, or hold up, someone's `up`).
kc_main() {
	local verb="${1:-}"
	shift || true
	case "$verb" in
	up | down | kill-leader | kill-broker | start-broker)
		mkdir -p "$(kc_dir)" "$state/started"
		take_lock 8 "$(kc_dir)/lock" "cluster: another scripts/services.sh cluster verb" || return 1
		;;
	esac
	case "$verb" in
	up) kc_up && kc_env ;;
	down) kc_down ;;
	status) kc_status ;;
	env) kc_env ;;
	kill-leader) kc_kill_leader "${1:-}" "${2:-}" ;;
	kill-broker) kc_kill "${1:-}" ;;
	start-broker) kc_start_broker "${1:-}" ;;
	*)
		echo "usage: $0 cluster up|down|status|env|kill-leader TOPIC PARTITION|kill-broker N|start-broker N" >&2
		return 2
		;;
	esac
}
