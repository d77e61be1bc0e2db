#!/usr/bin/env bash
# This node's certificate for Ray's mutual TLS, issued at start (the start commands of the `ray up`
# files run it before `ray start`): Ray checks that a node's certificate names the IP it dialled,
# and an autoscaled node learns its IP only at launch, so each node signs its own with the issuing
# CA of deploy/secrets/nodes/ (under Ray's root, whose key stays where make-secrets.sh ran).
# The node's key never leaves the node: OUT_DIR is outside every file mount.
#
# Usage: deploy/ray-node-cert.sh NODE_IP [OUT_DIR]   (OUT_DIR default ~/.pdserve-ray)
#   writes OUT_DIR/node.pem (the certificate, then the issuer's: RAY_TLS_SERVER_CERT) and
#   OUT_DIR/node.key (RAY_TLS_SERVER_KEY).
set -euo pipefail
if [[ $# -lt 1 || "$1" == "--help" || "$1" == "-h" ]]; then sed -n 2,10p "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
ip=$1
out=${2:-$HOME/.pdserve-ray}
src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets/nodes"
for f in ray-ca.pem ray-issuer.pem ray-issuer.key; do
  [[ -f "$src/$f" ]] || { echo "ray-node-cert.sh: $src/$f missing: run deploy/make-secrets.sh before \`ray up\`" >&2; exit 1; }
done
umask 077
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$tmp/node.key" -out "$tmp/node.csr" \
  -subj "/CN=pdserve Ray node" 2>/dev/null
san="IP:$ip"; [[ "$ip" == 127.0.0.1 ]] || san+=",IP:127.0.0.1"
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth,clientAuth\n' "$san" > "$tmp/ext"
openssl x509 -req -in "$tmp/node.csr" -CA "$src/ray-issuer.pem" -CAkey "$src/ray-issuer.key" \
  -set_serial "0x$(openssl rand -hex 16)" -days 825 -extfile "$tmp/ext" -out "$tmp/leaf.pem" 2>/dev/null
if ! openssl verify -CAfile "$src/ray-ca.pem" -untrusted "$src/ray-issuer.pem" "$tmp/leaf.pem" >/dev/null 2>&1; then
  echo "ray-node-cert.sh: the certificate for $ip does not verify against $src/ray-ca.pem: run make-secrets.sh again" >&2
  exit 1
fi
cat "$tmp/leaf.pem" "$src/ray-issuer.pem" > "$tmp/node.pem"
mv "$tmp/node.key" "$out/node.key"
mv "$tmp/node.pem" "$out/node.pem"
