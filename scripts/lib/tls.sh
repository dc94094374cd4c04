# The stack's certificate authority, sourced by scripts/stack.sh (which sets
# STACK_DIR, log and die).
#
# One CA per stack, made on the first `up` in $STACK_DIR/tls (git-ignored,
# never committed): ca.crt is public (every client verifies the servers
# with it), ca.key and each server's key are 0600. A certificate is made
# again when it is missing or expires within 30 days; the CA itself lasts
# ten years, a server's certificate a year.

TLS_DIR=$STACK_DIR/tls
TLS_CA=$TLS_DIR/ca.crt

# tls_ca: the stack's CA, made when missing.
tls_ca() {
  command -v openssl >/dev/null || die "openssl is needed to make the stack's certificates (apt-get install openssl)"
  mkdir -p "$TLS_DIR"
  chmod 0755 "$TLS_DIR"
  if [ -s "$TLS_DIR/ca.key" ] && [ -s "$TLS_CA" ] && openssl x509 -in "$TLS_CA" -noout -checkend 2592000 >/dev/null 2>&1; then
    return
  fi
  log "making the stack's certificate authority ($TLS_CA)"
  (umask 077; openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$TLS_DIR/ca.key" 2>/dev/null) \
    || die "openssl could not make the CA's key"
  openssl req -x509 -new -key "$TLS_DIR/ca.key" -sha256 -days 3650 -subj "/CN=effectively stack CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$TLS_CA" 2>/dev/null || die "openssl could not make the CA's certificate"
  # A new CA: every certificate it did not sign is made again.
  rm -f "$TLS_DIR"/*.crt.issued
}

# tls_issue NAME CN SAN: $TLS_DIR/NAME.crt and NAME.key (0600), signed by the
# stack's CA for the subject alternative names SAN (e.g.
# "IP:127.0.0.1,DNS:localhost"); kept while valid, for the same names, from
# the same CA.
tls_issue() {
  local name=$1 cn=$2 san=$3 crt=$TLS_DIR/$1.crt key=$TLS_DIR/$1.key
  tls_ca
  if [ -s "$crt" ] && [ -s "$key" ] && [ "$(cat "$crt.issued" 2>/dev/null)" = "$san" ] \
    && openssl x509 -in "$crt" -noout -checkend 2592000 >/dev/null 2>&1 \
    && openssl verify -CAfile "$TLS_CA" "$crt" >/dev/null 2>&1; then
    return
  fi
  log "issuing $crt for $san"
  (umask 077; openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$key" 2>/dev/null) \
    || die "openssl could not make $key"
  local ext
  ext=$(mktemp)
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=%s\n' "$san" >"$ext"
  openssl req -new -key "$key" -subj "/CN=$cn" 2>/dev/null \
    | openssl x509 -req -CA "$TLS_CA" -CAkey "$TLS_DIR/ca.key" -CAcreateserial -sha256 -days 365 \
        -extfile "$ext" -out "$crt" 2>/dev/null \
    || { rm -f "$ext"; die "openssl could not sign $crt"; }
  rm -f "$ext"
  echo "$san" >"$crt.issued"
}
