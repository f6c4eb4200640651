#!/usr/bin/env bash
# A Kubernetes control plane on this machine: etcd, kube-apiserver and
# kube-controller-manager on free ports, with RBAC, service-account tokens and
# garbage collection as in a real cluster. No nodes: pods stay Pending.
#
#   hack/cluster.sh up   [--dir DIR]   start it; prints `export KUBECONFIG=...`
#   hack/cluster.sh down [--dir DIR]   stop what `up` started and remove DIR
#   hack/cluster.sh env  [--dir DIR]   print the export line of a running one
#
# DIR defaults to $GOODPUT_CLUSTER_DIR or .cache/cluster in the repository.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${GOODPUT_CLUSTER_DIR:-$ROOT/.cache/cluster}"
SERVICE_CIDR="10.0.0.0/24"
FIRST_SERVICE_IP="10.0.0.1"
READY_TIMEOUT="${CLUSTER_READY_TIMEOUT:-120}"

log() { echo "cluster: $*" >&2; }
die() { log "$*"; exit 1; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

host_ip() {
  local ip
  ip="$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9]+\.' | grep -v '^127\.' | head -1 || true)"
  echo "${ip:-127.0.0.1}"
}

running() {
  [[ -s "$DIR/pids" ]] || return 1
  local pid
  while read -r _ pid; do kill -0 "$pid" 2>/dev/null || return 1; done <"$DIR/pids"
}

make_pki() {
  local pki="$DIR/pki" ip="$1"
  mkdir -p "$pki"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=goodput-test-ca" \
    -keyout "$pki/ca.key" -out "$pki/ca.crt" 2>/dev/null
  cat >"$pki/apiserver.ext" <<EOF
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$ip,IP:$FIRST_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
  openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
    -keyout "$pki/apiserver.key" -out "$pki/apiserver.csr" 2>/dev/null
  openssl x509 -req -in "$pki/apiserver.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$pki/apiserver.ext" -out "$pki/apiserver.crt" 2>/dev/null
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  local admin_token cm_token
  admin_token="$(openssl rand -hex 24)"
  cm_token="$(openssl rand -hex 24)"
  # token,user,uid,"groups"
  cat >"$pki/tokens.csv" <<EOF
$admin_token,admin,admin,"system:masters"
$cm_token,system:kube-controller-manager,kube-controller-manager,""
EOF
  echo "$admin_token" >"$pki/admin.token"
  echo "$cm_token" >"$pki/controller-manager.token"
  chmod 600 "$pki"/*.key "$pki"/*.token "$pki/tokens.csv"
}

write_kubeconfig() {
  local out="$1" server="$2" user="$3" token="$4"
  cat >"$out" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: goodput-test
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$DIR/pki/ca.crt")
users:
- name: $user
  user:
    token: $token
contexts:
- name: goodput-test
  context: {cluster: goodput-test, user: $user, namespace: default}
current-context: goodput-test
EOF
  chmod 600 "$out"
}

start() {
  local name="$1"; shift
  "$@" >"$DIR/logs/$name.log" 2>&1 &
  echo "$name $!" >>"$DIR/pids"
}

wait_ready() {
  local kubectl="$1" deadline=$((SECONDS + READY_TIMEOUT))
  until "$kubectl" --kubeconfig "$DIR/admin.kubeconfig" get --raw /readyz >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      tail -n 30 "$DIR/logs/kube-apiserver.log" >&2 || true
      die "kube-apiserver not ready after ${READY_TIMEOUT}s (logs in $DIR/logs)"
    fi
    running || { tail -n 30 "$DIR"/logs/*.log >&2; die "a component exited (logs in $DIR/logs)"; }
    sleep 0.5
  done
  [[ -x "$(cat "$DIR/bin")/kube-controller-manager" ]] || return 0
  deadline=$((SECONDS + READY_TIMEOUT))
  until "$kubectl" --kubeconfig "$DIR/admin.kubeconfig" -n default get serviceaccount default >/dev/null 2>&1; do
    ((SECONDS > deadline)) && die "controller-manager created no default ServiceAccount (logs in $DIR/logs)"
    sleep 0.5
  done
}

up() {
  if running; then
    log "already running in $DIR"
    echo "export KUBECONFIG=$DIR/admin.kubeconfig"
    return
  fi
  [[ -d "$DIR" ]] && down_quiet
  local bin
  bin="$("$ROOT/hack/k8s-binaries.sh" | tail -n 1)"
  local kubectl="$bin/kubectl"
  [[ -x "$kubectl" ]] || kubectl="$(command -v kubectl)" || die "no kubectl"
  mkdir -p "$DIR/logs" "$DIR/etcd"
  : >"$DIR/pids"
  echo "$bin" >"$DIR/bin"
  local ip etcd_port peer_port api_port
  ip="$(host_ip)"
  etcd_port="$(free_port)"; peer_port="$(free_port)"; api_port="$(free_port)"
  make_pki "$ip"
  local pki="$DIR/pki"

  start etcd "$bin/etcd" --name goodput-test --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "goodput-test=http://127.0.0.1:$peer_port" --log-level warn

  start kube-apiserver "$bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 0.0.0.0 --secure-port "$api_port" --insecure-port 0 --advertise-address "$ip" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" --token-auth-file "$pki/tokens.csv" \
    --authorization-mode Node,RBAC --allow-privileged=true \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --api-audiences https://kubernetes.default.svc \
    --kubelet-preferred-address-types InternalIP,Hostname \
    --profiling=false --v 1

  write_kubeconfig "$DIR/admin.kubeconfig" "https://127.0.0.1:$api_port" admin "$(cat "$pki/admin.token")"
  write_kubeconfig "$DIR/controller-manager.kubeconfig" "https://127.0.0.1:$api_port" \
    system:kube-controller-manager "$(cat "$pki/controller-manager.token")"

  if [[ -x "$bin/kube-controller-manager" ]]; then
    start kube-controller-manager "$bin/kube-controller-manager" \
      --kubeconfig "$DIR/controller-manager.kubeconfig" \
      --authentication-kubeconfig "$DIR/controller-manager.kubeconfig" \
      --authorization-kubeconfig "$DIR/controller-manager.kubeconfig" \
      --use-service-account-credentials=true --leader-elect=false \
      --port 0 --secure-port 0 \
      --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
      --service-cluster-ip-range "$SERVICE_CIDR" --v 1
  else
    log "no kube-controller-manager in $bin: no garbage collection, no Deployment controller"
  fi

  wait_ready "$kubectl"
  log "up: apiserver https://127.0.0.1:$api_port, logs in $DIR/logs"
  echo "export KUBECONFIG=$DIR/admin.kubeconfig"
}

stop_pids() {
  [[ -f "$DIR/pids" ]] || return 0
  local name pid
  # Reverse order: controller-manager, then apiserver, then etcd.
  tac "$DIR/pids" | while read -r name pid; do
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

down_quiet() {
  stop_pids
  rm -rf "$DIR"
}

down() {
  if [[ ! -d "$DIR" ]]; then log "nothing in $DIR"; return; fi
  down_quiet
  log "down"
}

cmd="${1:-}"
shift || true
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) DIR="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done

case "$cmd" in
  up) up ;;
  down) down ;;
  env) running || die "not running in $DIR"; echo "export KUBECONFIG=$DIR/admin.kubeconfig" ;;
  *) echo "usage: $0 up|down|env [--dir DIR]" >&2; exit 2 ;;
esac
