#!/usr/bin/env bash
# Start (or reuse) a PostgreSQL server on 127.0.0.1 for agentkv's store tests and print its URL.
#
#   export AGENTKV_TEST_POSTGRES_URL="$(bash scripts/start_postgres.sh)"
#
# Idempotent: installs Debian's postgresql package if no server binaries exist, creates a
# cluster in $AGENTKV_PG_DATA once, starts it unless it already runs, creates the `agentkv`
# role (LOGIN CREATEDB: the tests create one database per test) and database, and prints
# the SQLAlchemy URL on stdout (everything else goes to stderr). Listens on loopback only.
# Stop it with: runuser -u postgres -- pg_ctl -D "$AGENTKV_PG_DATA" stop
set -euo pipefail

PGDATA_DIR="${AGENTKV_PG_DATA:-/var/tmp/agentkv-postgres}"
PORT="${AGENTKV_PG_PORT:-54329}"
ROLE="agentkv"
PASSWORD="agentkv"

log() { echo "start_postgres: $*" >&2; }

find_bindir() {
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

BINDIR="$(find_bindir)"
if [[ -z "$BINDIR" || ! -x "$BINDIR/pg_ctl" ]]; then
    log "installing postgresql with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql >&2
    BINDIR="$(find_bindir)"
fi

# The server refuses to run as root: run it (and the admin client) as the postgres user.
if [[ "$(id -u)" == "0" ]]; then
    as_pg() { runuser -u postgres -- "$@"; }
    mkdir -p "$PGDATA_DIR"
    chown postgres:postgres "$PGDATA_DIR"
else
    as_pg() { "$@"; }
    mkdir -p "$PGDATA_DIR"
fi
chmod 700 "$PGDATA_DIR"

if [[ ! -f "$PGDATA_DIR/PG_VERSION" ]]; then
    log "creating a cluster in $PGDATA_DIR"
    as_pg "$BINDIR/initdb" -D "$PGDATA_DIR" -U postgres --encoding=UTF8 \
        --auth-local=trust --auth-host=scram-sha-256 >&2
fi

if ! as_pg "$BINDIR/pg_ctl" -D "$PGDATA_DIR" status >/dev/null 2>&1; then
    log "starting the server on 127.0.0.1:$PORT"
    as_pg "$BINDIR/pg_ctl" -D "$PGDATA_DIR" -l "$PGDATA_DIR/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $PORT -c unix_socket_directories=$PGDATA_DIR -c max_connections=300" \
        start >&2
fi

psql_admin() {
    as_pg "$BINDIR/psql" -h "$PGDATA_DIR" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -tAc "$1"
}

if [[ "$(psql_admin "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" != "1" ]]; then
    log "creating role $ROLE"
    psql_admin "CREATE ROLE $ROLE LOGIN CREATEDB PASSWORD '$PASSWORD'" >&2
fi
if [[ "$(psql_admin "SELECT 1 FROM pg_database WHERE datname = '$ROLE'")" != "1" ]]; then
    log "creating database $ROLE"
    psql_admin "CREATE DATABASE $ROLE OWNER $ROLE" >&2
fi

echo "postgresql+psycopg2://$ROLE:$PASSWORD@127.0.0.1:$PORT/$ROLE"
