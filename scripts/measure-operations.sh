#!/usr/bin/env bash
# Measures the figures of docs/operations.md on this machine: table and
# index size per outbox and processed-event row, WAL per event (written,
# published by `millwright relay`, deleted by its cleaner), the relay's
# database connections, CPU and memory.
#
#   bash scripts/measure-operations.sh [events]      # default 50000
#
# It works in a scratch schema owned by a scratch role, so that the WAL of
# its statements can be read from pg_stat_statements by user (the server
# is shared; pg_current_wal_lsn counts everyone's WAL, so its figure is an
# upper bound). Both are dropped at the end. Needs Postgres with
# pg_stat_statements, and Kafka (MILLWRIGHT_TEST_KAFKA_BROKERS, default
# 127.0.0.1:9092) for the relay.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${1:-50000}
BASE=${MILLWRIGHT_TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}
BROKERS=${MILLWRIGHT_TEST_KAFKA_BROKERS:-127.0.0.1:9092}
ID=opsmeas_$(date +%s)_$$
HOSTPART=${BASE#postgres://*@}
URL="postgres://${ID}@${HOSTPART}&search_path=${ID}&application_name=${ID}"
ADDR=127.0.0.1:$((20000 + RANDOM % 20000))
BIN=$(mktemp -d)/millwright

q() { psql -X -q -At "$BASE" -c "$1"; }
cleanup() {
	[[ -n "${RELAY:-}" ]] && kill "$RELAY" 2>/dev/null && wait "$RELAY" 2>/dev/null
	q "DROP SCHEMA IF EXISTS ${ID} CASCADE" >/dev/null
	q "DROP ROLE IF EXISTS ${ID}" >/dev/null
}
trap cleanup EXIT

q "CREATE ROLE ${ID} LOGIN" >/dev/null
q "CREATE SCHEMA ${ID} AUTHORIZATION ${ID}" >/dev/null
go build -o "$BIN" ./cmd/millwright
"$BIN" migrate --database-url "$URL" >/dev/null

lsn() { q "SELECT pg_current_wal_lsn()"; }
walsince() { q "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '$1')"; }
# WAL bytes, full-page images and calls of the role's statements matching a pattern.
stmt_wal() {
	q "SELECT COALESCE(sum(wal_bytes),0)::bigint || ' ' || COALESCE(sum(wal_fpi),0) || ' ' || COALESCE(sum(calls),0)
	   FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid
	   WHERE r.rolname = '${ID}' AND s.query ~* '$1'"
}
rows() { q "SELECT count(*) FROM ${ID}.millwright_outbox WHERE $1"; }
sizes() {
	q "SELECT 'table ' || pg_relation_size('${ID}.millwright_outbox') || ' toast ' || COALESCE(pg_total_relation_size(reltoastrelid), 0)
	   || ' ' || (SELECT string_agg(replace(c.relname, 'millwright_outbox_', '') || ' ' || pg_relation_size(c.oid), ' ' ORDER BY c.relname)
	              FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = '${ID}.millwright_outbox'::regclass)
	   FROM pg_class WHERE oid = '${ID}.millwright_outbox'::regclass"
}

echo "# $(date -u +%FT%TZ) $(uptime)"
echo "# events=$N"

# A typical order event: 90-byte JSON payload, CloudEvents metadata; the
# shape of outbox.TxPublisher's INSERT.
cat >"${BIN%/*}/insert.sql" <<'SQL'
INSERT INTO millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, metadata)
VALUES (gen_random_uuid()::text, 'opsmeas.events', 'order', 'order-' || (random() * 100000)::int, 'order.created.v1',
        jsonb_build_object('order_id', gen_random_uuid()::text, 'customer_id', 'customer-' || (random() * 10000)::int, 'amount', 4200, 'currency', 'EUR'),
        jsonb_build_object('ce_source', 'examples/orders/orders', 'traceparent', '00-' || md5(random()::text) || '-' || left(md5(random()::text), 16) || '-01'));
SQL
W=$((N / 10))

# 1. Steady flow, on the empty table: the relay runs while writers (2
# clients) commit one event per transaction; every row is inserted, leased
# and marked within moments.
MILLWRIGHT_DATABASE_URL="$URL" MILLWRIGHT_TRANSPORT=kafka MILLWRIGHT_KAFKA_BROKERS="$BROKERS" \
	MILLWRIGHT_RELAY_ADDR="$ADDR" MILLWRIGHT_OUTBOX_RETENTION=0 "$BIN" relay 2>>"${BIN%/*}/relay.log" &
RELAY=$!
until curl -sf "http://$ADDR/readyz" >/dev/null; do sleep 0.2; done
pages0=$(q "SELECT pg_relation_size('${ID}.millwright_outbox')")
read -r sb0 _ _ < <(stmt_wal '.')
before=$(lsn)
tps=$(PGOPTIONS="-c search_path=${ID}" pgbench -n -f "${BIN%/*}/insert.sql" -t "$W" -c 2 \
	"postgres://${ID}@${HOSTPART}&application_name=${ID}" | awk '/^tps/ {print int($3)}')
until [[ $(rows "status = 'pending'") == 0 ]]; do sleep 0.2; done
server=$(walsince "$before")
read -r sb1 _ _ < <(stmt_wal '.')
kill -TERM "$RELAY"
wait "$RELAY" || true
RELAY=
q "VACUUM ANALYZE ${ID}.millwright_outbox" >/dev/null
grown=$(( $(q "SELECT pg_relation_size('${ID}.millwright_outbox')") - pages0 ))
echo "steady flow: $((2 * W)) events at $tps tx/s (2 clients) with the relay running: table $((grown / (2 * W))) B/event; $(sizes)"
echo "steady flow: WAL $(((sb1 - sb0) / (2 * W))) B/event written and published, server WAL $((server / (2 * W))) B/event (upper bound)"
q "TRUNCATE ${ID}.millwright_outbox" >/dev/null

# 2. Writers alone: one event per transaction, the shape of outbox.TxPublisher's
# INSERT (a typical order event: 90-byte JSON payload, CloudEvents metadata).
before=$(lsn)
tps=$(PGOPTIONS="-c search_path=${ID}" pgbench -n -f "${BIN%/*}/insert.sql" -t "$W" -c 1 \
	"postgres://${ID}@${HOSTPART}&application_name=${ID}" | awk '/^tps/ {print int($3)}')
server=$(walsince "$before")
read -r wb wfpi wcalls < <(stmt_wal '^INSERT INTO millwright_outbox')
echo "write: $W single-event transactions at $tps tx/s (1 client); statement WAL $((wb / wcalls)) B/event ($wfpi full-page images); server WAL in the interval $((server / W)) B/event (everyone's, upper bound)"

# Backlog for the relay: the rest in one statement.
q "INSERT INTO ${ID}.millwright_outbox (event_id, topic, aggregate_type, aggregate_id, event_type, payload, metadata)
   SELECT gen_random_uuid()::text, 'opsmeas.events', 'order', 'order-' || (random() * 100000)::int, 'order.created.v1',
          jsonb_build_object('order_id', gen_random_uuid()::text, 'customer_id', 'customer-' || (random() * 10000)::int, 'amount', 4200, 'currency', 'EUR'),
          jsonb_build_object('ce_source', 'examples/orders/orders', 'traceparent', '00-' || md5(random()::text) || '-' || left(md5(random()::text), 16) || '-01')
   FROM generate_series(1, $((N - W)))" >/dev/null
q "VACUUM ANALYZE ${ID}.millwright_outbox" >/dev/null
echo "size, $N pending: $(sizes)"

# 3. The relay publishes the backlog to Kafka.
read -r ib _ _ < <(stmt_wal '.')
before=$(lsn)
start=$(date +%s.%N)
MILLWRIGHT_DATABASE_URL="$URL" MILLWRIGHT_TRANSPORT=kafka MILLWRIGHT_KAFKA_BROKERS="$BROKERS" \
	MILLWRIGHT_RELAY_ADDR="$ADDR" MILLWRIGHT_OUTBOX_RETENTION=0 "$BIN" relay 2>"${BIN%/*}/relay.log" &
RELAY=$!
maxconn=0
while [[ $(rows "status = 'pending'") != 0 ]]; do
	c=$(q "SELECT count(*) FROM pg_stat_activity WHERE application_name = '${ID}'")
	((c > maxconn)) && maxconn=$c
	kill -0 "$RELAY" 2>/dev/null || { cat "${BIN%/*}/relay.log"; exit 1; }
	sleep 0.2
done
secs=$(echo "$(date +%s.%N) - $start" | bc)
server=$(walsince "$before")
read -r ab afpi _ < <(stmt_wal '.')
read -r ut st < <(awk '{print $14, $15}' /proc/$RELAY/stat)
hwm=$(awk '/VmHWM/ {print $2}' /proc/$RELAY/status)
idle=0
for _ in $(seq 15); do
	c=$(q "SELECT count(*) FROM pg_stat_activity WHERE application_name = '${ID}'")
	((c > idle)) && idle=$c
	sleep 0.2
done
echo "relay: $N events in ${secs}s ($(echo "$N / $secs" | bc) events/s, startup included); statement WAL $(((ab - ib) / N)) B/event ($((afpi)) full-page images in all); server WAL $((server / N)) B/event (upper bound)"
echo "relay process: CPU $(((ut + st) * 10)) ms ($(echo "scale=2; ($ut + $st) / 100 / $secs" | bc) cores), peak RSS $((hwm / 1024)) MiB; database connections: at most $maxconn while publishing, $idle idle"
curl -s "http://$ADDR/readyz" | tail -1
kill -TERM "$RELAY"
wait "$RELAY" || true
RELAY=
q "VACUUM ANALYZE ${ID}.millwright_outbox" >/dev/null
echo "size, $N published (after VACUUM): $(sizes)"

# 4. The cleaner deletes them (retention 1ms), in its batches of 1000.
read -r db0 _ _ < <(stmt_wal '^DELETE FROM millwright_outbox')
before=$(lsn)
MILLWRIGHT_DATABASE_URL="$URL" MILLWRIGHT_TRANSPORT=kafka MILLWRIGHT_KAFKA_BROKERS="$BROKERS" \
	MILLWRIGHT_RELAY_ADDR="$ADDR" MILLWRIGHT_OUTBOX_RETENTION=1ms MILLWRIGHT_CLEAN_INTERVAL=100ms "$BIN" relay 2>>"${BIN%/*}/relay.log" &
RELAY=$!
until [[ $(rows "true") == 0 ]]; do sleep 0.2; done
server=$(walsince "$before")
kill -TERM "$RELAY"
wait "$RELAY" || true
RELAY=
read -r db1 dfpi dcalls < <(stmt_wal '^DELETE FROM millwright_outbox')
echo "clean: statement WAL $(((db1 - db0) / N)) B/event ($dfpi full-page images, $dcalls statements); server WAL $((server / N)) B/event (upper bound)"

# 5. Processed-event marks (idempotency), one per consumer and event.
q "INSERT INTO ${ID}.millwright_processed_events (consumer, event_id, processed_at)
   SELECT 'billing', gen_random_uuid()::text, now() - i * interval '1 ms' FROM generate_series(1, $N) i" >/dev/null
q "VACUUM ANALYZE ${ID}.millwright_processed_events" >/dev/null
echo "processed events, $N marks: $(q "SELECT 'table ' || pg_relation_size('${ID}.millwright_processed_events') || ' ' ||
	(SELECT string_agg(c.relname || ' ' || pg_relation_size(c.oid), ' ') FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
	 WHERE i.indrelid = '${ID}.millwright_processed_events'::regclass)")"
echo "# $(uptime)"
