# Sourced from ~/.bashrc on every node of a `ray up` cluster (its setup_commands add the line):
# shells on the node (`ray exec`, `ray attach`, and the SSH command `ray down` runs) get Ray's
# token and TLS settings, so `ray status` works there, and a `ray` whose `ray stop` first drains
# the router (deploy/drain.sh): `ray down` runs a bare `ray stop` on the head over SSH, through
# `bash --login -i` with ~/.bashrc sourced, before it terminates the nodes.
_pdserve_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$_pdserve_root/deploy/secrets/nodes/ray_auth_token" \
  RAY_USE_TLS=1 RAY_TLS_SERVER_CERT="$HOME/.pdserve-ray/node.pem" RAY_TLS_SERVER_KEY="$HOME/.pdserve-ray/node.key" \
  RAY_TLS_CA_CERT="$_pdserve_root/deploy/secrets/nodes/ray-ca.pem"
ray() {
  if [[ "${1:-}" == stop ]]; then "$_pdserve_root/deploy/drain.sh"; fi
  command "$_pdserve_root/.venv/bin/ray" "$@"
}
