#!/bin/sh
# The image's entrypoint: run the command as the user the compose file names (FEDMED_UID:FEDMED_GID, the host user
# who owns the certificates, keys and ./results), with a private home in the container's own /state volume.
set -e
umask 077
for secret in /certs/*.key /keys/*; do
  if [ -f "$secret" ] && [ ! -r "$secret" ]; then
    echo "fedmed-entrypoint: $secret is not readable by uid $(id -u): run the containers as the user who owns" \
         "it, with FEDMED_UID and FEDMED_GID in .env (see the header of docker-compose.yml)" >&2
    exit 78
  fi
done
mkdir -p "$FLWR_HOME" "$FEDMED_CACHE_DIR"
# FEDMED_WAIT_FOR=host:port: wait (up to 10 minutes) until it accepts connections, e.g. a hospital for its SuperLink
# after `docker-compose start`, instead of a restart loop
if [ -n "${FEDMED_WAIT_FOR:-}" ]; then
  python3 - "$FEDMED_WAIT_FOR" <<'PY' || exit 75
import socket, sys, time
host, _, port = sys.argv[1].rpartition(":")
deadline = time.time() + 600
while True:
    try:
        socket.create_connection((host, int(port)), 3).close()
        break
    except OSError:
        if time.time() > deadline:
            sys.exit(f"fedmed-entrypoint: {sys.argv[1]} did not answer within 10 minutes")
        time.sleep(2)
PY
fi
exec "$@"
