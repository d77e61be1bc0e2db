#!/usr/bin/env bash
# Secrets for a `ray up` cluster (deploy/cluster-aws.yaml), written into deploy/secrets/ (git
# ignores it; `ray up` copies it with the checkout to every node):
#   ray_auth_token           Ray's token authentication (RAY_AUTH_MODE=token on every node)
#   tokens                   pdserve client tokens, `token name` per line (security.tokens_file)
#   ca.pem, server.pem/.key  a private CA and the router's TLS certificate it signed
#                            (clients: pdserve ... --tls-ca deploy/secrets/ca.pem)
#
# Usage: deploy/make-secrets.sh [--help] [NAME_OR_IP ...]
#   each NAME_OR_IP goes into the certificate (the addresses clients dial; default: localhost
#   and 127.0.0.1, for `ray attach -p 50051`). Existing files are kept: delete one to renew it.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n 2,11p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets"
mkdir -p "$dir" && chmod 700 "$dir" && cd "$dir"
umask 077
names=("$@"); [[ ${#names[@]} -gt 0 ]] || names=(localhost 127.0.0.1)
san=""
for n in "${names[@]}"; do
  if [[ "$n" =~ ^[0-9.]+$ || "$n" == *:* ]]; then san+="IP:$n,"; else san+="DNS:$n,"; fi
done
[[ -f ray_auth_token ]] || { openssl rand -hex 32 > ray_auth_token; echo "wrote ray_auth_token"; }
[[ -f tokens ]] || { echo "$(openssl rand -hex 32) admin" > tokens; echo "wrote tokens (one token, named admin)"; }
if [[ ! -f ca.pem ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.pem \
    -days 825 -subj "/CN=pdserve cluster CA" 2>/dev/null
  echo "wrote ca.pem (keep ca.key off the cluster if you can)"
fi
if [[ ! -f server.pem ]]; then
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key -out server.csr \
    -subj "/CN=pdserve router" 2>/dev/null
  printf 'subjectAltName=%s\n' "${san%,}" > server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 825 \
    -extfile server.ext 2>/dev/null
  rm -f server.csr server.ext
  echo "wrote server.pem for ${names[*]}"
fi
