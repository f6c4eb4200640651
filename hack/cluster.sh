#!/usr/bin/env bash
# A Kubernetes cluster on this machine: etcd, kube-apiserver and
# kube-controller-manager on free ports, with RBAC, service-account tokens and
# garbage collection as in a real cluster. Without --node there are no nodes and pods
# stay Pending; with --node this machine also becomes the one node: containerd, runc,
# a CNI bridge, kubelet, kube-proxy (iptables mode) and kube-scheduler, so pods run.
#
#   hack/cluster.sh up   [--node] [--dir DIR]  start it; prints `export KUBECONFIG=...`
#                                              (and `export CONTAINERD_ADDRESS=...` with --node)
#   hack/cluster.sh down [--dir DIR]           stop what `up` started (by PID), remove DIR and,
#                                              for a node, its containers, network and cgroups
#   hack/cluster.sh env  [--dir DIR]           print the export lines of a running one
#   hack/cluster.sh restart NAME [--signal SIG] [--pause S] [--dir DIR]
#                                              stop one component (etcd, kube-apiserver, kubelet, ...)
#                                              with SIG (TERM), wait S seconds (0), start it again
#                                              with the same command line: a fault, for the tests
#
# DIR defaults to $GOODPUT_CLUSTER_DIR or .cache/cluster in the repository. `up` is
# idempotent: a running cluster is reused, a dead or partial one is cleaned away first.
#
# The node needs root on Debian or Ubuntu (it installs containerd, runc, the CNI plugins,
# iptables and conntrack from the distribution when missing). Elsewhere, use kind
# (https://kind.sigs.k8s.io): `make demo` picks it when `docker` and `kind` are on the PATH.
#
# Images: containerd keeps its image store under ${GOODPUT_CACHE:-~/.cache/goodput}/containerd,
# across `down`/`up`, so imported images (hack/images.sh import) survive a restart.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${GOODPUT_CLUSTER_DIR:-$ROOT/.cache/cluster}"
SERVICE_CIDR="${GOODPUT_SERVICE_CIDR:-10.0.0.0/24}"  # room for 254 Services; more for scale tests
FIRST_SERVICE_IP="10.0.0.1"
READY_TIMEOUT="${CLUSTER_READY_TIMEOUT:-120}"
CACHE_ROOT="${GOODPUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/goodput}"
NODE=0
POD_CIDR="10.244.0.0/24"
BRIDGE="goodput0"
CNI_NETWORK="goodput"
PAUSE_IMAGE="localhost/goodput/pause:3.4"
NODE_PACKAGES=(containerd runc containernetworking-plugins iptables conntrack socat ethtool iproute2 gcc libc6-dev)

log() { echo "cluster: $*" >&2; }
die() { log "$*"; exit 1; }

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

host_ip() {
  local ip
  ip="$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -E '^[0-9]+\.' | grep -v '^127\.' | grep -v '^10\.244\.' | head -1 || true)"
  echo "${ip:-127.0.0.1}"
}

# Every process of the cluster in $1 (default $DIR) is alive.
running() {
  local dir="${1:-$DIR}" pid
  [[ -s "$dir/pids" ]] || return 1
  while read -r _ pid; do kill -0 "$pid" 2>/dev/null || return 1; done <"$dir/pids"
}

add_token() {
  local file="$1" user="$2" groups="$3" token
  token="$(openssl rand -hex 24)"
  echo "$token,$user,$file,\"$groups\"" >>"$DIR/pki/tokens.csv"
  echo "$token" >"$DIR/pki/$file.token"
}

make_pki() {
  local pki="$DIR/pki" ip="$1" node_name="$2"
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
  # The apiserver's client certificate towards the kubelet (logs, exec, port-forward).
  printf 'extendedKeyUsage=clientAuth\n' >"$pki/client.ext"
  openssl req -newkey rsa:2048 -nodes -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" \
    -keyout "$pki/kubelet-client.key" -out "$pki/kubelet-client.csr" 2>/dev/null
  openssl x509 -req -in "$pki/kubelet-client.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -extfile "$pki/client.ext" -out "$pki/kubelet-client.crt" 2>/dev/null
  openssl genrsa -out "$pki/sa.key" 2048 2>/dev/null
  openssl rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  # token,user,uid,"groups": one token, one identity per component
  : >"$pki/tokens.csv"
  add_token admin admin system:masters
  add_token controller-manager system:kube-controller-manager ""
  add_token scheduler system:kube-scheduler ""
  add_token kube-proxy system:kube-proxy ""
  add_token kubelet "system:node:$node_name" system:nodes
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

wait_apiserver() {
  local kubectl="$1" deadline=$((SECONDS + READY_TIMEOUT))
  until "$kubectl" --kubeconfig "$DIR/admin.kubeconfig" get --raw /readyz >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      tail -n 30 "$DIR/logs/kube-apiserver.log" >&2 || true
      die "kube-apiserver not ready after ${READY_TIMEOUT}s (logs in $DIR/logs)"
    fi
    running || { tail -n 30 "$DIR"/logs/*.log >&2; die "a component exited (logs in $DIR/logs)"; }
    sleep 0.5
  done
}

wait_ready() {
  local kubectl="$1" deadline
  wait_apiserver "$kubectl"
  [[ -x "$(cat "$DIR/bin")/kube-controller-manager" ]] || return 0
  deadline=$((SECONDS + READY_TIMEOUT))
  until "$kubectl" --kubeconfig "$DIR/admin.kubeconfig" -n default get serviceaccount default >/dev/null 2>&1; do
    ((SECONDS > deadline)) && die "controller-manager created no default ServiceAccount (logs in $DIR/logs)"
    sleep 0.5
  done
}

# --- the node ------------------------------------------------------------------------

node_requirements() {
  [[ $(id -u) -eq 0 ]] || die "--node needs root (containerd, iptables, cgroups). Without root use kind: \
\`make demo\` uses it when docker and kind are installed."
  [[ -r /etc/os-release ]] && grep -qiE '^(ID|ID_LIKE)=.*(debian|ubuntu)' /etc/os-release \
    || die "--node is written for Debian or Ubuntu (packages from apt). Elsewhere use kind: \
\`make demo\` uses it when docker and kind are installed."
  local missing=() p
  for p in "${NODE_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  if [[ ${#missing[@]} -gt 0 ]]; then
    log "installing ${missing[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

containerd_address() { echo "$DIR/containerd/containerd.sock"; }

write_containerd_config() {
  local cfg="$DIR/containerd/config.toml"
  mkdir -p "$DIR/containerd" "$CACHE_ROOT/containerd" "$DIR/cni/net.d"
  # restrict_oom_score_adj: this kind of VM refuses negative OOM scores, which the CRI
  # plugin otherwise gives every sandbox. cgroupfs, not systemd: no systemd here.
  cat >"$cfg" <<EOF
version = 2
root = "$CACHE_ROOT/containerd"
state = "$DIR/containerd/state"
[grpc]
  address = "$(containerd_address)"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$DIR/cni/net.d"
EOF
  # Our own conf dir, so no other file (podman's 87-podman.conflist) can win.
  cat >"$DIR/cni/net.d/10-goodput.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$CNI_NETWORK",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$DIR/cni/ipam"
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

ctr_k8s() { ctr --address "$(containerd_address)" -n k8s.io "$@"; }

# The pause image, built from the Kubernetes tree's pause.c: no registry to pull it from.
ensure_pause_image() {
  ctr_k8s images ls -q | grep -qx "$PAUSE_IMAGE" && return
  local src tree work
  tree="$(find "$CACHE_ROOT"/k8s-*/src -maxdepth 1 -type d -name 'kubernetes-*' 2>/dev/null | head -1)"
  src="$tree/build/pause/linux/pause.c"
  [[ -f "$src" ]] || die "no pause.c under $CACHE_ROOT (hack/k8s-binaries.sh keeps the Kubernetes source there)"
  work="$(mktemp -d)"
  gcc -Os -static -DVERSION=3.4-goodput -o "$work/pause" "$src"
  strip "$work/pause" 2>/dev/null || true
  python3 "$ROOT/hack/single_file_image.py" --binary "$work/pause" --name "$PAUSE_IMAGE" --out "$work/pause.tar"
  ctr_k8s images import "$work/pause.tar" >&2
  rm -rf "$work"
  log "built and imported $PAUSE_IMAGE"
}

wait_for() {
  local what="$1" timeout="$2"; shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS > deadline)) && die "$what not ready after ${timeout}s (logs in $DIR/logs)"
    running || { tail -n 30 "$DIR"/logs/*.log >&2; die "a component exited while waiting for $what (logs in $DIR/logs)"; }
    sleep 0.5
  done
}

# One node per machine: the bridge, iptables and containerd's image store are shared.
claim_node() {
  local owner="$CACHE_ROOT/node-owner" other
  mkdir -p "$CACHE_ROOT"
  if [[ -f "$owner" ]]; then
    other="$(cat "$owner")"
    if [[ "$other" != "$DIR" && -f "$other/pids" ]] && running "$other"; then
      die "a one-node cluster already runs in $other; \`$0 down --dir $other\` first"
    fi
  fi
  echo "$DIR" >"$owner"
}

release_node() {
  local owner="$CACHE_ROOT/node-owner"
  [[ -f "$owner" && "$(cat "$owner")" == "$DIR" ]] && rm -f "$owner"
  return 0
}

up_node() {
  local bin="$1" kubectl="$2" ip="$3" node_name="$4" api="$5"
  local pki="$DIR/pki"
  # Pod traffic through the bridge must pass iptables, and the node must forward.
  sysctl -qw net.ipv4.ip_forward=1
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null || log "bridge netfilter sysctl unavailable"

  write_containerd_config
  start containerd containerd --config "$DIR/containerd/config.toml"
  wait_for containerd 60 ctr --address "$(containerd_address)" version
  ensure_pause_image

  write_kubeconfig "$DIR/kubelet.kubeconfig" "https://$ip:$api" "system:node:$node_name" "$(cat "$pki/kubelet.token")"
  write_kubeconfig "$DIR/kube-proxy.kubeconfig" "https://$ip:$api" system:kube-proxy "$(cat "$pki/kube-proxy.token")"
  write_kubeconfig "$DIR/scheduler.kubeconfig" "https://127.0.0.1:$api" system:kube-scheduler "$(cat "$pki/scheduler.token")"

  mkdir -p "$DIR/kubelet"
  cat >"$DIR/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
address: $ip
port: $(free_port)
readOnlyPort: 0
healthzPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
# No cluster DNS here: pods get the node's resolv.conf.
resolvConf: /etc/resolv.conf
serializeImagePulls: false
evictionHard: {memory.available: "200Mi", nodefs.available: "5%", imagefs.available: "5%"}
imageGCHighThresholdPercent: 95
imageGCLowThresholdPercent: 90
EOF
  start kubelet "$bin/kubelet" --config "$DIR/kubelet-config.yaml" \
    --kubeconfig "$DIR/kubelet.kubeconfig" --root-dir "$DIR/kubelet" --cert-dir "$DIR/kubelet/pki" \
    --container-runtime remote --container-runtime-endpoint "unix://$(containerd_address)" \
    --pod-infra-container-image "$PAUSE_IMAGE" \
    --hostname-override "$node_name" --node-ip "$ip" --v 1

  start kube-proxy "$bin/kube-proxy" --kubeconfig "$DIR/kube-proxy.kubeconfig" \
    --hostname-override "$node_name" --proxy-mode iptables --cluster-cidr "$POD_CIDR" \
    --conntrack-max-per-core 0 --metrics-bind-address "127.0.0.1:$(free_port)" \
    --healthz-bind-address "127.0.0.1:$(free_port)" --v 1

  reject_unrouted_services

  start kube-scheduler "$bin/kube-scheduler" --kubeconfig "$DIR/scheduler.kubeconfig" \
    --authentication-kubeconfig "$DIR/scheduler.kubeconfig" --authorization-kubeconfig "$DIR/scheduler.kubeconfig" \
    --leader-elect=false --port 0 --secure-port "$(free_port)" --bind-address 127.0.0.1 --v 1

  wait_for "node $node_name" "$READY_TIMEOUT" node_ready "$kubectl" "$node_name"
}

# A connection to the service range that kube-proxy's nat rules did not send to an endpoint is refused
# here, as kube-proxy refuses a Service without endpoints. kube-proxy commits its filter table (where
# that refusal lives) and its nat table (where the endpoints are) one after the other, so when a
# Service's endpoints come back a new connection can for an instant meet neither; it would then leave
# by the default route, and on this machine whatever answers there (an egress proxy answering any
# address's port 80 with an empty 404) would reach the client as if the Service had answered.
UNROUTED_COMMENT="goodput: service range, no endpoint"
reject_unrouted_services() {
  local chain
  for chain in OUTPUT FORWARD; do
    iptables -C "$chain" -d "$SERVICE_CIDR" -m comment --comment "$UNROUTED_COMMENT" -j REJECT 2>/dev/null \
      || iptables -A "$chain" -d "$SERVICE_CIDR" -m comment --comment "$UNROUTED_COMMENT" -j REJECT
  done
}

node_ready() {
  [[ "$("$1" --kubeconfig "$DIR/admin.kubeconfig" get node "$2" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" == True ]]
}

# Containers outlive containerd (their shims keep them), so they are killed first.
remove_containers() {
  [[ -S "$(containerd_address)" ]] || return 0
  local id
  for id in $(ctr_k8s tasks ls -q 2>/dev/null); do ctr_k8s tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
  sleep 1
  for id in $(ctr_k8s tasks ls -q 2>/dev/null); do ctr_k8s tasks delete -f "$id" >/dev/null 2>&1 || true; done
  for id in $(ctr_k8s containers ls -q 2>/dev/null); do ctr_k8s containers delete "$id" >/dev/null 2>&1 || true; done
}

remove_node_leftovers() {
  local sock
  sock="$(containerd_address)"
  # shims of this containerd, should any remain
  pkill -9 -f "containerd-shim.*-address $sock" 2>/dev/null || true
  # mounts under the cluster dir (pod volumes, sandboxes' shm) and the pods' netns
  local m
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v d="$DIR/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r)
  while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done < <(awk -v d="$CACHE_ROOT/containerd/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r)
  if [[ -d /var/run/netns ]]; then
    for m in /var/run/netns/cni-*; do
      [[ -e "$m" ]] || continue
      umount "$m" 2>/dev/null || true
      rm -f "$m"
    done
  fi
  ip link delete "$BRIDGE" 2>/dev/null || true
  # iptables: the service range's refusal above, kube-proxy's KUBE-* chains and the CNI plugins' CNI-* chains
  { iptables -S 2>/dev/null || true; } | grep -F -- "--comment \"$UNROUTED_COMMENT\"" | sed 's/^-A/-D/' \
    | while read -r rule; do eval "iptables $rule" 2>/dev/null || true; done
  local table chain
  for table in filter nat mangle; do
    # jumps into those chains from the built-in ones first, then the chains themselves
    { iptables -t "$table" -S 2>/dev/null || true; } | awk '/^-A (INPUT|OUTPUT|FORWARD|PREROUTING|POSTROUTING) .*-j (KUBE-|CNI-)/' \
      | sed 's/^-A/-D/' | while read -r rule; do
      eval "iptables -t $table $rule" 2>/dev/null || true
    done
    for chain in $({ iptables -t "$table" -S 2>/dev/null || true; } | awk '/^-N (KUBE-|CNI-)/ {print $2}'); do
      iptables -t "$table" -F "$chain" 2>/dev/null || true
    done
    for chain in $({ iptables -t "$table" -S 2>/dev/null || true; } | awk '/^-N (KUBE-|CNI-)/ {print $2}'); do
      iptables -t "$table" -X "$chain" 2>/dev/null || true
    done
  done
  # the kubelet's pod cgroups, deepest first, once their last processes have gone
  local ctl left
  for _ in $(seq 20); do
    left=0
    for ctl in /sys/fs/cgroup/*/; do
      [[ -d "$ctl/kubepods" ]] || continue
      find "$ctl/kubepods" -depth -type d -exec rmdir {} \; 2>/dev/null || true
      [[ -d "$ctl/kubepods" ]] && left=1
    done
    [[ $left -eq 0 ]] && break
    sleep 0.5
  done
  [[ $left -eq 0 ]] || log "some kubepods cgroups could not be removed (processes left in them?)"
  return 0
}

# --- up / down -----------------------------------------------------------------------

up() {
  if running; then
    if [[ $NODE -eq 1 && ! -f "$DIR/node" ]]; then
      die "a control plane without a node runs in $DIR; \`$0 down --dir $DIR\` first"
    fi
    log "already running in $DIR"
    print_env
    return
  fi
  [[ $NODE -eq 1 ]] && node_requirements
  [[ -d "$DIR" ]] && down_quiet
  [[ $NODE -eq 1 ]] && claim_node
  local bin
  if [[ $NODE -eq 1 ]]; then
    bin="$("$ROOT/hack/k8s-binaries.sh" --node | tail -n 1)"
  else
    bin="$("$ROOT/hack/k8s-binaries.sh" | tail -n 1)"
  fi
  local kubectl="$bin/kubectl"
  [[ -x "$kubectl" ]] || kubectl="$(command -v kubectl)" || die "no kubectl"
  mkdir -p "$DIR/logs" "$DIR/etcd"
  : >"$DIR/pids"
  echo "$bin" >"$DIR/bin"
  [[ $NODE -eq 1 ]] && touch "$DIR/node"
  local ip etcd_port peer_port api_port node_name
  ip="$(host_ip)"
  node_name="$(hostname | tr '[:upper:]' '[:lower:]')"
  etcd_port="$(free_port)"; peer_port="$(free_port)"; api_port="$(free_port)"
  make_pki "$ip" "$node_name"
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
    --kubelet-client-certificate "$pki/kubelet-client.crt" --kubelet-client-key "$pki/kubelet-client.key" \
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
    # only once the API server is ready (its RBAC roles made): the controller manager gives up
    # after 20 s of refused health checks, which a loaded machine can take
    wait_apiserver "$kubectl"
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
  [[ $NODE -eq 1 ]] && up_node "$bin" "$kubectl" "$ip" "$node_name" "$api_port"
  log "up: apiserver https://127.0.0.1:$api_port$([[ $NODE -eq 1 ]] && echo ", node $node_name Ready"), logs in $DIR/logs"
  print_env
}

print_env() {
  echo "export KUBECONFIG=$DIR/admin.kubeconfig"
  [[ -f "$DIR/node" ]] && echo "export CONTAINERD_ADDRESS=$(containerd_address)"
  return 0
}

stop_pids() {
  [[ -f "$DIR/pids" ]] || return 0
  local name pid
  # Reverse order: the node's components, controller-manager, apiserver, then etcd.
  tac "$DIR/pids" | while read -r name pid; do
    [[ "$name" == containerd ]] && remove_containers
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
}

down_quiet() {
  stop_pids
  if [[ -f "$DIR/node" ]]; then remove_node_leftovers; release_node; fi
  rm -rf "$DIR"
}

down() {
  if [[ ! -d "$DIR" ]]; then log "nothing in $DIR"; return; fi
  down_quiet
  log "down"
}

# Stops component $1 with signal $2, waits $3 seconds, starts it again with the command line it
# ran with (read from /proc before it stops), appending to its log, and records its new PID.
restart_component() {
  local name="$1" signal="$2" pause="$3" pid
  pid="$(awk -v n="$name" '$1 == n {print $2}' "$DIR/pids" 2>/dev/null | tail -n 1)"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || die "no running $name in $DIR"
  local args=()
  mapfile -d '' -t args <"/proc/$pid/cmdline"
  kill "-$signal" "$pid"
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  sleep "$pause"
  "${args[@]}" >>"$DIR/logs/$name.log" 2>&1 &
  sed -i "s/^$name $pid\$/$name $!/" "$DIR/pids"
  log "$name restarted: pid $pid stopped with SIG$signal, pid $! started after ${pause}s"
}

cmd="${1:-}"
shift || true
COMPONENT=""
SIGNAL=TERM
PAUSE=0
if [[ "$cmd" == restart && $# -gt 0 && "$1" != --* ]]; then COMPONENT="$1"; shift; fi
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) DIR="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
    --node) NODE=1; shift ;;
    --signal) SIGNAL="${2#SIG}"; shift 2 ;;
    --pause) PAUSE="$2"; shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done

case "$cmd" in
  up) up ;;
  down) down ;;
  env) running || die "not running in $DIR"; print_env ;;
  restart) [[ -n "$COMPONENT" ]] || die "restart needs a component's name"; restart_component "$COMPONENT" "$SIGNAL" "$PAUSE" ;;
  *) echo "usage: $0 up [--node]|down|env|restart NAME [--signal SIG] [--pause S] [--dir DIR]" >&2; exit 2 ;;
esac
