#!/usr/bin/env bash
# Register hospitals' public keys at a SuperLink started with SuperNode authentication.
#
#   deploy/register_hospitals.sh CONNECTION KEYS_DIR/HOSPITAL.pub [...]
#
# CONNECTION names a SuperLink in $FLWR_HOME/config.toml (with its root-certificates). Only
# SuperNodes holding a registered key may join; any other is refused by the SuperLink. A key the
# SuperLink holds already (a second run of this script, a SuperLink restarted on its database) is
# reported and kept. Hand the same .pub files to every hospital as its PEER_KEYS folder
# (deploy/start_supernode.sh): under secure aggregation they are how hospitals know each other.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 CONNECTION KEY.pub [KEY.pub ...]" >&2
  exit 2
fi
connection=$1; shift
for key in "$@"; do
  name=$(basename "$key" .pub)
  if out=$(flwr supernode register "$key" "$connection" --name "$name" 2>&1); then
    echo "$out"
  elif echo "$out" | grep -q "already in use"; then
    echo "$name: its key is registered already"
  else
    echo "$out" >&2
    exit 1
  fi
done
