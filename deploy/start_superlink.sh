#!/usr/bin/env bash
# Start the consortium's SuperLink with TLS and hospital (SuperNode) authentication.
#
#   deploy/start_superlink.sh CERT_DIR [--host 0.0.0.0] [--port 9200] [--database state/superlink.db]
#   deploy/start_superlink.sh --insecure ...      # plain text: only on a closed test network
#
# CERT_DIR holds ca.crt, server.pem and server.key from deploy/make_certificates.sh. Hospitals,
# the ServerApp and `flwr` all talk to HOST:PORT. Runtime dependency installation stays off: the
# app runs with the packages installed here.
set -euo pipefail
host=0.0.0.0; port=9200; database=state/superlink.db; tls=(); auth=(--enable-supernode-auth)
if [ "${1:-}" = "--insecure" ]; then
  echo "WARNING: plain-text SuperLink without hospital authentication" >&2
  tls=(--insecure); auth=(); shift
else
  if [ $# -lt 1 ]; then echo "usage: $0 CERT_DIR [--host H] [--port P] [--database FILE] | --insecure ..." >&2; exit 2; fi
  certs=$1; shift
  tls=(--ssl-ca-certfile "$certs/ca.crt" --ssl-certfile "$certs/server.pem" --ssl-keyfile "$certs/server.key")
fi
while [ $# -gt 0 ]; do
  case $1 in
    --host) host=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --database) database=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$(dirname "$database")"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
exec flower-superlink "${tls[@]}" "${auth[@]}" --host "$host" --port "$port" --database "$database" \
  --disable-runtime-dependency-installation
