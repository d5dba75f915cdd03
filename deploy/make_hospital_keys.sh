#!/usr/bin/env bash
# Create one SuperNode authentication key pair per hospital (ECDSA P-384, OpenSSH format).
#
#   deploy/make_hospital_keys.sh OUT_DIR HOSPITAL [HOSPITAL ...]
#
# OUT_DIR/HOSPITAL is the private key (stays at the hospital, passed to flower-supernode with
# --auth-supernode-private-key); OUT_DIR/HOSPITAL.pub is registered at the SuperLink with
# deploy/register_hospitals.sh. An existing key is never overwritten.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT_DIR HOSPITAL [HOSPITAL ...]" >&2
  exit 2
fi
out=$1; shift
mkdir -p "$out"
for hospital in "$@"; do
  if [ -e "$out/$hospital" ]; then
    echo "$out/$hospital exists; kept"
    continue
  fi
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "$hospital" -f "$out/$hospital"
  echo "key pair for $hospital: $out/$hospital (private) and $out/$hospital.pub"
done
