#!/usr/bin/env bash
# Make the compose demo's secrets: a random token and a self-signed TLS certificate for
# the parameter server (names ps, localhost, 127.0.0.1), in docker/secrets/ (or DIR).
#   bash docker/make-secrets.sh [DIR]
# Existing files are kept. They are mounted at /run/secrets/ by docker/compose.yaml and
# never copied into an image (.dockerignore leaves docker/secrets/ out of build contexts).
set -euo pipefail
DIR="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets}"
mkdir -p "$DIR"
chmod 700 "$DIR"
umask 077
[ -s "$DIR/ps_token" ] || openssl rand -hex 32 >"$DIR/ps_token"
if [ ! -s "$DIR/ps_tls_cert" ] || [ ! -s "$DIR/ps_tls_key" ]; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=ps" \
    -addext "subjectAltName=DNS:ps,DNS:localhost,IP:127.0.0.1" \
    -keyout "$DIR/ps_tls_key" -out "$DIR/ps_tls_cert" 2>/dev/null
fi
# The containers run as uid 10001: let it read the files (the directory stays private).
chmod 644 "$DIR/ps_token" "$DIR/ps_tls_cert" "$DIR/ps_tls_key"
echo "secrets in $DIR: ps_token ps_tls_cert ps_tls_key"
