#!/usr/bin/env bash
# Start one hospital's SuperNode beside its data, with TLS and its authentication key, as fedmed-supernode
# (deploy/fedmed_supernode.py: Flower's SuperNode with one long-lived ClientApp process instead of one per message).
#
#   deploy/start_supernode.sh HOSPITAL SUPERLINK_ADDRESS CA_CERT KEY DATA_DIR STATE_DIR [EXTRA_NODE_CONFIG]
#   deploy/start_supernode.sh --insecure HOSPITAL SUPERLINK_ADDRESS - - DATA_DIR STATE_DIR [...]
#
# EXTRA_NODE_CONFIG adds node-config entries, e.g. "device='cuda' modalities='flair,t1ce'" or
# "bit-width=8". The hospital's data never leaves DATA_DIR; what it must remember between rounds
# goes to STATE_DIR (keep it on persistent storage).
set -euo pipefail
tls_mode=tls
if [ "${1:-}" = "--insecure" ]; then tls_mode=insecure; shift; fi
if [ $# -lt 6 ]; then
  echo "usage: $0 [--insecure] HOSPITAL SUPERLINK_ADDRESS CA_CERT KEY DATA_DIR STATE_DIR [EXTRA_NODE_CONFIG]" >&2
  exit 2
fi
hospital=$1; superlink=$2; ca=$3; key=$4; data=$5; state=$6; extra=${7:-}
port=${SUPERNODE_PORT:-9094}
mkdir -p "$state"
if [ "$tls_mode" = insecure ]; then
  echo "WARNING: plain-text connection to the SuperLink" >&2
  security=(--insecure)
else
  security=(--root-certificates "$ca" --auth-supernode-private-key "$key")
  extra="identity-key='$key' $extra"  # signs the hospital's name for runs with hospital-keys
fi
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
python=${FEDMED_PYTHON:-python3}  # the Python that has Flower and the project installed
exec "$python" "$(dirname "$0")/fedmed_supernode.py" "${security[@]}" --superlink "$superlink" --host 127.0.0.1 --port "$port" \
  --node-config "hospital='$hospital' data-dir='$data' state-dir='$state' $extra"
