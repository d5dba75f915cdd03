#!/usr/bin/env bash
# Register hospitals' public keys at a SuperLink started with SuperNode authentication.
#
#   deploy/register_hospitals.sh CONNECTION KEYS_DIR/HOSPITAL.pub [...]
#
# CONNECTION names a SuperLink in $FLWR_HOME/config.toml (with its root-certificates). Only
# SuperNodes holding a registered key may join; any other is refused by the SuperLink.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 CONNECTION KEY.pub [KEY.pub ...]" >&2
  exit 2
fi
connection=$1; shift
for key in "$@"; do
  name=$(basename "$key" .pub)
  flwr supernode register "$key" "$connection" --name "$name"
done
