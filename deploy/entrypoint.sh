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
exec "$@"
