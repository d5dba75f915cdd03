#!/usr/bin/env bash
# Write a hospital's policy: deploy/hospital-policy.toml and the fingerprints of the consortium's public keys it pins.
#
#   deploy/make_hospital_policy.sh POLICY_FILE KEY.pub [KEY.pub ...]
#
# Run by the hospital's officer, with the .pub files of every hospital of the consortium (this one's included),
# after reading each fingerprint (printed here, and by `fedmed key-fingerprint KEY.pub` or `ssh-keygen -l -f
# KEY.pub`) to that hospital's officer, or hearing it from them, by a channel that does not pass through the
# coordinator. A key whose fingerprint was not compared must not be listed: a hospital counts only the keys its
# policy pins, whatever folder (peer-keys) holds them. An existing policy is never overwritten.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 POLICY_FILE KEY.pub [KEY.pub ...]" >&2
  exit 2
fi
out=$1; shift
python=${FEDMED_PYTHON:-python3}  # a Python with the project installed (`fedmed key-fingerprint`)
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -e "$out" ]; then
  echo "$out exists; kept"
  exit 0
fi
keys=()
for key in "$@"; do  # named from where the officer stands, read from the project's folder below
  case $key in /*) keys+=("$key") ;; *) keys+=("$PWD/$key") ;; esac
done
peers=$(cd "$root" && "$python" -m cli.main key-fingerprint --peers "${keys[@]}")
mkdir -p "$(dirname "$out")"
{ cat "$root/deploy/hospital-policy.toml"; echo; echo "$peers"; } > "$out.tmp"
mv "$out.tmp" "$out"
echo "$out pins these keys; compare each fingerprint with its hospital's officer before starting the SuperNode:" >&2
(cd "$root" && "$python" -m cli.main key-fingerprint "${keys[@]}") >&2
