#!/usr/bin/env bash
# Secrets for a `ray up` cluster (deploy/cluster-aws.yaml, deploy/onprem-loopback.yaml), written
# into deploy/secrets/ (git ignores it), in three places by who may hold them:
#   ca.key, ray-ca.key       the two CAs' keys: never leave this machine (no file mount carries them)
#   ca.pem                   the router's CA (clients: pdserve ... --tls-ca deploy/secrets/ca.pem)
#   head/                    the head only, pushed with `ray rsync-up` (no file mount carries it):
#     server.pem, server.key   the router's TLS certificate (names every NAME_OR_IP) and its key
#     tokens                   pdserve client tokens, `token name` per line (security.tokens_file)
#   nodes/                   every node (a file mount): what a node needs to join Ray
#     ray_auth_token           Ray's token authentication (RAY_AUTH_MODE=token)
#     ray-ca.pem               the root every node trusts for Ray's mutual TLS (RAY_TLS_CA_CERT)
#     ray-issuer.pem/.key      a CA under it (pathlen 0, trusted by Ray only): each node issues its
#                              own Ray certificate for its IP at start (ray-node-cert.sh)
#
# Usage: deploy/make-secrets.sh [--help] [NAME_OR_IP ...]
#   NAME_OR_IP: the addresses clients dial the router at (the head's DNS name or public IP:
#   `ray get-head-ip CLUSTER.yaml` once the head is up); localhost and 127.0.0.1 are always in
#   (`ray attach -p 50051`). Existing files are kept (delete one to renew it), but server.pem is
#   issued again when it lacks a NAME_OR_IP given.
set -euo pipefail
if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then sed -n 2,19p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
names=(localhost 127.0.0.1)
for a in "$@"; do
  [[ "$a" != -* ]] || { echo "make-secrets.sh: unknown option $a (--help)" >&2; exit 2; }
  names+=("$a")
done

dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets"
mkdir -p "$dir" && chmod 700 "$dir" && cd "$dir"
if [[ -f tokens || -f server.key || -f ray_auth_token ]]; then
  echo "make-secrets.sh: $dir has the old layout, which \`ray up\` copied to every node (CA key, server key," \
       "client tokens): treat those as exposed. Move it away (mv deploy/secrets deploy/secrets.old) and run again." >&2
  exit 1
fi
umask 077
mkdir -p head nodes
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
serial() { echo "0x$(openssl rand -hex 16)"; }

# --- the router's CA and certificate (clients trust ca.pem) ---
if [[ ! -f ca.pem ]]; then
  openssl req -x509 "${ec[@]}" -keyout ca.key -out ca.pem -days 825 -subj "/CN=pdserve router CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  echo "wrote ca.pem (ca.key stays here)"
fi
san=""
for n in "${names[@]}"; do
  if [[ "$n" =~ ^[0-9.]+$ || "$n" == *:* ]]; then san+="IP:$n,"; else san+="DNS:$n,"; fi
done
if [[ -f head/server.pem ]]; then  # issued again when it lacks a name asked for now
  have=",$(openssl x509 -in head/server.pem -noout -ext subjectAltName | sed -n 2p | sed 's/IP Address:/IP:/g; s/ //g'),"
  for w in ${san//,/ }; do [[ "$have" == *",$w,"* ]] || { rm -f head/server.pem; break; }; done
fi
if [[ ! -f head/server.pem ]]; then
  openssl req "${ec[@]}" -keyout head/server.key -out server.csr -subj "/CN=pdserve router" 2>/dev/null
  printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' "${san%,}" > server.ext
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -set_serial "$(serial)" -out head/server.pem \
    -days 825 -extfile server.ext 2>/dev/null
  rm -f server.csr server.ext
  echo "wrote head/server.pem for ${names[*]}"
fi
[[ -f head/tokens ]] || { echo "$(openssl rand -hex 32) admin" > head/tokens; echo "wrote head/tokens (one token, named admin)"; }

# --- Ray: token, root CA (key stays here), the issuing CA every node holds ---
[[ -f nodes/ray_auth_token ]] || { openssl rand -hex 32 > nodes/ray_auth_token; echo "wrote nodes/ray_auth_token"; }
if [[ ! -f nodes/ray-ca.pem ]]; then
  openssl req -x509 "${ec[@]}" -keyout ray-ca.key -out nodes/ray-ca.pem -days 825 -subj "/CN=pdserve Ray CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  rm -f nodes/ray-issuer.pem  # a new root: a new issuer under it
  echo "wrote nodes/ray-ca.pem (ray-ca.key stays here)"
fi
if [[ ! -f nodes/ray-issuer.pem ]]; then
  # no name constraints: gRPC's TLS (BoringSSL) refuses a chain with IP constraints ("unsupported
  # name constraint type"); it signs node certificates only (pathlen 0), which only Ray trusts
  openssl req "${ec[@]}" -keyout nodes/ray-issuer.key -out issuer.csr -subj "/CN=pdserve Ray node issuer" 2>/dev/null
  printf 'basicConstraints=critical,CA:TRUE,pathlen:0\nkeyUsage=critical,keyCertSign\n' > issuer.ext
  openssl x509 -req -in issuer.csr -CA nodes/ray-ca.pem -CAkey ray-ca.key -set_serial "$(serial)" \
    -out nodes/ray-issuer.pem -days 825 -extfile issuer.ext 2>/dev/null
  rm -f issuer.csr issuer.ext
  echo "wrote nodes/ray-issuer.pem"
fi
