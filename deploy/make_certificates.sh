#!/usr/bin/env bash
# Create the consortium's certificate authority and the SuperLink's TLS certificate.
#
#   deploy/make_certificates.sh OUT_DIR NAME_OR_ADDRESS [NAME_OR_ADDRESS ...]
#
# Every name and address hospitals use to reach the SuperLink goes into the certificate's
# subjectAltName (e.g. superlink.example.org 10.0.0.5 superlink localhost 127.0.0.1).
# Writes OUT_DIR/ca.crt (give it to every hospital and to whoever runs `flwr`), ca.key (keep it
# offline), server.pem and server.key (the SuperLink's). Keys are EC P-384.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT_DIR NAME_OR_ADDRESS [NAME_OR_ADDRESS ...]" >&2
  exit 2
fi
out=$1; shift
mkdir -p "$out"
cd "$out"
san=""
for name in "$@"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+="IP:$name,"; else san+="DNS:$name,"; fi
done
san=${san%,}
curve=(-newkey ec -pkeyopt ec_paramgen_curve:secp384r1)
openssl req -x509 "${curve[@]}" -sha384 -days 3650 -nodes -keyout ca.key -out ca.crt \
  -subj "/CN=fedmed consortium CA" -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
openssl req "${curve[@]}" -nodes -keyout server.key -out server.csr -subj "/CN=$1" 2>/dev/null
printf "subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyAgreement\nextendedKeyUsage=serverAuth\n" \
  "$san" > server.ext
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.pem -days 825 -sha384 \
  -extfile server.ext 2>/dev/null
rm -f server.csr server.ext ca.srl
chmod 600 ca.key server.key
echo "CA: $out/ca.crt  SuperLink certificate: $out/server.pem (for $san)"
