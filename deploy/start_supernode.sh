#!/usr/bin/env bash
# Start one hospital's SuperNode beside its data, with TLS and its authentication key, as fedmed-supernode
# (deploy/fedmed_supernode.py: Flower's SuperNode with one long-lived ClientApp process instead of one per message).
#
#   deploy/start_supernode.sh --policy POLICY [--approve APP_HASH] HOSPITAL SUPERLINK_ADDRESS CA_CERT KEY PEER_KEYS \
#       DATA_DIR STATE_DIR [EXTRA_NODE_CONFIG]
#   deploy/start_supernode.sh --insecure [--any-app] HOSPITAL SUPERLINK_ADDRESS - - - DATA_DIR STATE_DIR [...]
#
# The hospital runs only the app it reviewed: by default the app of the checkout this script lies in (its hash,
# `fedmed app-hash`, goes into the node config's approved-apps), or the hash given with --approve (comma-separated
# for several). PEER_KEYS is a folder of the consortium's registered public keys, <hospital>.pub (the files the
# coordinator registers with deploy/register_hospitals.sh, this hospital's own included): under secure aggregation
# every other hospital must prove it holds one of them. POLICY is the hospital's own policy file
# (deploy/make_hospital_policy.sh writes one from deploy/hospital-policy.toml): it requires secure aggregation and
# pins the consortium's keys by fingerprint, compared by the hospitals' officers, not through the coordinator, so a
# key the coordinator adds to PEER_KEYS counts for nothing.
# EXTRA_NODE_CONFIG adds node-config entries, e.g. "device='cuda' modalities='flair,t1ce'" or "policy-file='...'".
# The hospital's data never leaves DATA_DIR; what it must remember between rounds (its audit log, privacy ledger,
# secure-aggregation memory) goes to STATE_DIR (keep it on persistent storage).
# --insecure (plain text, no keys) and --any-app (run whatever app the SuperLink sends) are for closed test
# networks only.
set -euo pipefail
tls_mode=tls; approve=""; any_app=(); policy=""
while [ $# -gt 0 ]; do
  case $1 in
    --insecure) tls_mode=insecure; shift ;;
    --approve) approve=${2:-}; shift $(( $# > 1 ? 2 : 1 )) ;;
    --policy) policy=${2:-}; shift $(( $# > 1 ? 2 : 1 )) ;;
    --any-app) any_app=(--any-app); shift ;;
    *) break ;;
  esac
done
if [ $# -lt 7 ]; then
  echo "usage: $0 --policy POLICY [--insecure] [--approve APP_HASH] HOSPITAL SUPERLINK_ADDRESS CA_CERT KEY PEER_KEYS" \
       "DATA_DIR STATE_DIR [EXTRA_NODE_CONFIG]" >&2
  exit 2
fi
hospital=$1; superlink=$2; ca=$3; key=$4; peers=$5; data=$6; state=$7; extra=${8:-}
port=${SUPERNODE_PORT:-9094}
python=${FEDMED_PYTHON:-python3}  # the Python that has Flower and the project installed
root=$(cd "$(dirname "$0")/.." && pwd)
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
# every argument is checked before anything slow (the app's hash) starts
for hash in ${approve//,/ }; do
  if ! [[ $hash =~ ^[0-9a-fA-F]{64}$ ]]; then
    echo "$0: --approve: '$hash' is not an app hash (64 hexadecimal digits, as \`fedmed app-hash --hash-only APP_DIR\`" \
         "prints; comma-separated for several)" >&2
    exit 2
  fi
done
if [ -n "${approve//[, ]/}" ] || [ ${#any_app[@]} -gt 0 ]; then :; elif [ -n "$approve" ]; then
  echo "$0: --approve names no app hash" >&2
  exit 2
fi
if [ "$tls_mode" = insecure ]; then
  echo "WARNING: plain-text connection to the SuperLink, no hospital key: a closed test network only" >&2
  security=(--insecure)
else
  if [ ! -d "$peers" ] || [ ! -f "$key" ]; then
    echo "$0: KEY ($key) must be this hospital's private key and PEER_KEYS ($peers) the folder of the consortium's" \
         "registered <hospital>.pub files" >&2
    exit 2
  fi
  if [ ! -f "$policy" ]; then
    echo "$0: --policy POLICY must be this hospital's policy file, with the consortium's key fingerprints it pins" \
         "(deploy/make_hospital_policy.sh POLICY PEER_KEYS/*.pub, after comparing them with the other hospitals)" >&2
    exit 2
  fi
  security=(--root-certificates "$ca" --auth-supernode-private-key "$key")
  extra="policy-file='$policy' $extra"
  # the key signs the hospital's name (hospital-keys) and its secure-aggregation messages; peer-keys checks the others'
  extra="identity-key='$key' peer-keys='$peers' $extra"
fi
if [ ${#any_app[@]} -eq 0 ]; then
  if [ -z "$approve" ]; then  # the checkout beside this script: the app the hospital reviewed
    approve=$("$python" -m cli.main app-hash --hash-only "$root")
  fi
  extra="approved-apps='$approve' $extra"
fi
mkdir -p "$state"
exec "$python" "$root/deploy/fedmed_supernode.py" "${security[@]}" "${any_app[@]}" --superlink "$superlink" \
  --host 127.0.0.1 --port "$port" --node-config "hospital='$hospital' data-dir='$data' state-dir='$state' $extra"
