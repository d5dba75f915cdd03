#!/usr/bin/env bash
# The .env docker-compose.yml reads: containers run as you (FEDMED_UID, FEDMED_GID: you own the keys, certificates
# and ./results), and every hospital approves exactly this checkout's app (FEDMED_APPROVED_APPS: its SHA-256, as
# `fedmed app-hash` prints it and `flwr run .` sends it). Review the app's files first (`fedmed app-hash .` lists them).
#
#   deploy/compose_env.sh > .env            # from the checkout docker-compose.yml lies in; extra lines may follow
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${FEDMED_PYTHON:-python3}  # a Python with the project installed (`fedmed app-hash`)
hash=$("$python" -m cli.main app-hash --hash-only "$root")
printf 'FEDMED_UID=%s\nFEDMED_GID=%s\nFEDMED_APPROVED_APPS=%s\n' "$(id -u)" "$(id -g)" "$hash"
