#!/usr/bin/env bash
# Make a throw-away certificate authority and certificates for a dev / test NATS fleet.
#
#   infra/nats/tls/make-dev-certs.sh [OUT_DIR] [SERVER_NAME ...]
#
# OUT_DIR defaults to ./dev-certs. SERVER_NAMEs go into the server certificate's
# subjectAltName (host names or IP addresses clients and other nodes dial); default:
# localhost 127.0.0.1 nats-1.ddm.internal nats-2.ddm.internal nats-3.ddm.internal.
# Writes two certificate authorities, so that no client certificate can ever pass as a route:
#   ca.pem / ca-key.pem                  the client-facing dev CA (keep ca-key.pem off the servers)
#   server-cert.pem / server-key.pem     for every nats-server's client and leaf ports
#   client-cert.pem / client-key.pem     for clients when the server sets `verify: true`
#   route-ca.pem / route-ca-key.pem      the route-only CA (cluster routes verify against it alone)
#   route-cert.pem / route-key.pem       every cluster node's route certificate (mutual TLS)
# For production, use your organisation's CA; these certificates are for development only.
set -euo pipefail

out=${1:-./dev-certs}
shift || true
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  names=(localhost 127.0.0.1 nats-1.ddm.internal nats-2.ddm.internal nats-3.ddm.internal)
fi
days=${DDM_CERT_DAYS:-825}

command -v openssl >/dev/null || { echo "make-dev-certs: openssl not found; install it (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$out"
cd "$out"
umask 077

san=""
for n in "${names[@]}"; do
  if [[ $n =~ ^[0-9.]+$ || $n == *:* ]]; then san+="IP:$n,"; else san+="DNS:$n,"; fi
done
san=${san%,}

make_ca() {  # make_ca NAME COMMON_NAME
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -keyout "$1-key.pem" -out "$1.pem" -subj "/O=ddm-fleet dev/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}

echo "make-dev-certs: CA (clients) and route CA (cluster routes only)" >&2
make_ca ca "ddm-fleet dev CA"
make_ca route-ca "ddm-fleet dev route CA"

issue() {  # issue NAME SUBJECT_CN EXTENSIONS [CA_NAME]
  local name=$1 cn=$2 ext=$3 ca=${4:-ca}
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$name-key.pem" \
    -out "$name.csr" -subj "/O=ddm-fleet dev/CN=$cn"
  printf '%s\n' "$ext" > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA "$ca.pem" -CAkey "$ca-key.pem" -CAcreateserial -days "$days" \
    -extfile "$name.ext" -out "$name-cert.pem"
  rm -f "$name.csr" "$name.ext"
}

echo "make-dev-certs: server certificate for ${names[*]}" >&2
# serverAuth for clients, clientAuth too because leaf links dial other servers.
issue server "${names[0]}" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san"

echo "make-dev-certs: route certificate for ${names[*]} (route CA)" >&2
# A route both accepts (serverAuth) and dials (clientAuth) other nodes.
issue route "${names[0]} route" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san" route-ca

echo "make-dev-certs: client certificate" >&2
issue client "ddm-fleet client" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"

rm -f ca.srl route-ca.srl
chmod 644 ca.pem route-ca.pem server-cert.pem client-cert.pem route-cert.pem
echo "make-dev-certs: wrote $(pwd)/{ca,server-cert,server-key,client-cert,client-key,route-ca,route-cert,route-key}.pem" >&2
