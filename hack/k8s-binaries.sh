#!/usr/bin/env bash
# Builds kube-apiserver, kube-controller-manager and kubectl (with --node also
# kube-scheduler, kubelet and kube-proxy) from Debian's Kubernetes source package,
# once per machine, and prints the folder holding them and etcd.
#
# Cached under ${GOODPUT_CACHE:-~/.cache/goodput}/k8s-<version>/bin, so later runs
# take seconds. When KUBEBUILDER_ASSETS already holds kube-apiserver and etcd (the
# envtest convention) nothing is built and that folder is printed instead.
#
# Usage: hack/k8s-binaries.sh [--node]   # build if needed; last line of stdout is the bin dir
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-1.20.2}"
CACHE_ROOT="${GOODPUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/goodput}"
CACHE="$CACHE_ROOT/k8s-$K8S_VERSION"
BIN="$CACHE/bin"
WANT=(kube-apiserver kube-controller-manager kubectl)
NODE_BINARIES=(kube-scheduler kubelet kube-proxy)
if [[ "${1:-}" == "--node" ]]; then WANT+=("${NODE_BINARIES[@]}"); fi
APT_PACKAGES=(etcd-server golang-go rsync jq openssl dpkg-dev make)

log() { echo "k8s-binaries: $*" >&2; }

have_all() {
  local dir="$1"; shift
  for b in "$@"; do [[ -x "$dir/$b" ]] || return 1; done
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]] && have_all "$KUBEBUILDER_ASSETS" kube-apiserver etcd \
  && { [[ "${1:-}" != "--node" ]] || have_all "$KUBEBUILDER_ASSETS" "${NODE_BINARIES[@]}"; }; then
  log "using KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS"
  echo "$KUBEBUILDER_ASSETS"
  exit 0
fi

as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

apt_updated=0
apt_update_once() {
  if [[ $apt_updated -eq 0 ]]; then as_root apt-get update -qq >&2; apt_updated=1; fi
}

ensure_packages() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [[ ${#missing[@]} -gt 0 ]]; then
    log "installing ${missing[*]}"
    apt_update_once
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >&2
  fi
}

link_etcd() {
  local etcd
  etcd="$(command -v etcd || true)"
  [[ -n "$etcd" ]] || { log "etcd not found after installing etcd-server"; exit 1; }
  ln -sf "$etcd" "$BIN/etcd"
}

ensure_deb_src() {
  local list=/etc/apt/sources.list.d/goodput-deb-src.sources
  if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list; then
    log "adding a deb-src entry for bookworm"
    as_root tee "$list" >/dev/null <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    apt_updated=0
  fi
  apt_update_once
}

find_tree() {
  local d
  for d in "$1"/kubernetes-*; do
    if [[ -d "$d/vendor" && "$d" == *"$K8S_VERSION" ]]; then echo "$d"; return; fi
  done
}

fetch_source() {
  local src="$CACHE/src" tree
  # Debian names the folder after its package version, e.g. kubernetes-1.20.5+really1.20.2.
  tree="$(find_tree "$src")"
  if [[ -z "$tree" ]]; then
    ensure_deb_src
    rm -rf "$src" && mkdir -p "$src"
    log "fetching Debian's kubernetes/bookworm source"
    (cd "$src" && apt-get source -qq "kubernetes/bookworm" >&2)
    tree="$(find_tree "$src")"
    [[ -n "$tree" ]] || { log "unexpected source layout in $src"; exit 1; }
  fi
  echo "$tree"
}

# The vendored reflect2 v1.0.1 crashes the apiserver on the first custom resource
# when built with Go >= 1.18; v1.0.2 from Debian's Go package fixes it.
patch_reflect2() {
  local tree="$1" dest="$1/vendor/github.com/modern-go/reflect2"
  if [[ -f "$dest/.goodput-v1.0.2" ]]; then return; fi
  local tmp; tmp="$(mktemp -d)"
  (cd "$tmp" && apt-get download -qq golang-github-modern-go-reflect2-dev >&2)
  dpkg-deb -x "$tmp"/golang-github-modern-go-reflect2-dev_*.deb "$tmp/x"
  rm -rf "$dest" && mkdir -p "$dest"
  cp -a "$tmp/x/usr/share/gocode/src/github.com/modern-go/reflect2/." "$dest/"
  rm -f "$dest/go.mod" "$dest/go.sum"
  touch "$dest/.goodput-v1.0.2"
  rm -rf "$tmp"
  log "patched vendored reflect2 to v1.0.2"
}

build() {
  local tree="$1"
  mkdir -p "$tree/.go/src/k8s.io"
  ln -sfn "$tree" "$tree/.go/src/k8s.io/kubernetes"
  local what=() b
  for b in "${WANT[@]}"; do [[ -x "$BIN/$b" ]] || what+=("cmd/$b"); done
  log "building ${what[*]} (cold: 10-15 min on 2 cores, more with the node binaries)"
  local start=$SECONDS
  (
    cd "$tree/.go/src/k8s.io/kubernetes"
    export GOPATH="$tree/.go" CGO_ENABLED=0 GO111MODULE=off GOFLAGS=
    nice -n 10 make WHAT="${what[*]}" >&2
  )
  mkdir -p "$BIN"
  for b in "${what[@]}"; do b="${b#cmd/}"; install -m 0755 "$tree/_output/bin/$b" "$BIN/$b"; done
  log "built in $((SECONDS - start)) s"
}

main() {
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9
  ensure_packages
  mkdir -p "$BIN"
  if ! have_all "$BIN" "${WANT[@]}"; then
    local tree
    tree="$(fetch_source)"
    patch_reflect2 "$tree"
    build "$tree"
  fi
  link_etcd
  echo "$BIN"
}

main "$@"
