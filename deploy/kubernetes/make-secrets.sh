#!/usr/bin/env bash
# The Secrets the manifests read, in a namespace: hvd-ps-token (key `token`, a random
# 256-bit hex string) and hvd-ps-tls (type kubernetes.io/tls: a self-signed certificate for
# *.ps.NAMESPACE.svc, *.ps.NAMESPACE.svc.cluster.local and localhost, valid 365 days).
#   bash deploy/kubernetes/make-secrets.sh [NAMESPACE] [--rotate-token] [--print]
# Existing Secrets are kept, except the token with --rotate-token (then restart the
# servers: kubectl rollout restart statefulset/ps). --print writes the Secrets' YAML to
# stdout instead of applying them (no cluster needed). Needs kubectl and openssl.
# Docs: docs/deployment/kubernetes.md
set -euo pipefail
NAMESPACE="" ROTATE=0 PRINT=0
for arg in "$@"; do
  case "$arg" in
    --rotate-token) ROTATE=1 ;;
    --print) PRINT=1 ;;
    -*) echo "make-secrets.sh: unknown option $arg (--rotate-token, --print)" >&2; exit 2 ;;
    *) NAMESPACE="$arg" ;;
  esac
done
if [ -z "$NAMESPACE" ]; then
  NAMESPACE="$(kubectl config view --minify -o 'jsonpath={..namespace}' 2>/dev/null || true)"
  NAMESPACE="${NAMESPACE:-default}"
fi
for tool in kubectl openssl; do
  command -v "$tool" >/dev/null || { echo "make-secrets.sh: $tool not found" >&2; exit 1; }
done
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
umask 077

exists() {  # exists NAME: the Secret is already in the namespace (never with --print)
  ((PRINT == 0)) && kubectl get secret -n "$NAMESPACE" "$1" >/dev/null 2>&1
}

emit() {  # emit KUBECTL-CREATE-SECRET-ARGS...: print the Secret, or apply it
  if ((PRINT)); then
    echo "---"
    kubectl create secret "$@" -n "$NAMESPACE" --dry-run=client -o yaml
  else
    kubectl create secret "$@" -n "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f -
  fi
}

if ((ROTATE)) || ! exists hvd-ps-token; then
  openssl rand -hex 32 | tr -d '\n' >"$WORK/token"
  emit generic hvd-ps-token --from-file=token="$WORK/token"
fi
if ! exists hvd-ps-tls; then
  openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=ps.$NAMESPACE.svc" \
    -addext "subjectAltName=DNS:*.ps.$NAMESPACE.svc,DNS:*.ps.$NAMESPACE.svc.cluster.local,DNS:localhost" \
    -keyout "$WORK/tls.key" -out "$WORK/tls.crt" 2>/dev/null
  emit tls hvd-ps-tls --cert="$WORK/tls.crt" --key="$WORK/tls.key"
fi
((PRINT)) || echo "Secrets hvd-ps-token and hvd-ps-tls are in namespace $NAMESPACE" >&2
