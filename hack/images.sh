#!/usr/bin/env bash
# Builds the Goodput images without Docker, with buildah, on a Debian base made here by
# debootstrap, and imports them into containerd for a local cluster.
#
#   hack/images.sh base                       # localhost/goodput-base:bookworm
#   hack/images.sh build [runtime|operator|all]   # the images (default all); needs the base
#   hack/images.sh import [--containerd-socket PATH]   # into containerd's k8s.io namespace
#   hack/images.sh all [--containerd-socket PATH]      # base + build all + import
#   hack/images.sh prepare                    # base + build all + the archives import reads (no containerd)
#   hack/images.sh names                      # prints the base, runtime and operator image names
#
# Images (the tags manifests/operator.yaml and the operator's default runtime image name, pulled
# IfNotPresent):
#   ghcr.io/goodput-dev/goodput-runtime:<version>    CPU torch (2.13.0+cpu), from Dockerfile.runtime
#   ghcr.io/goodput-dev/goodput-operator:<version>   from Dockerfile.operator
# <version> is contract/goodput_contract/version.py's (= pyproject.toml's). stdout: the image names built or imported, one per line;
# progress goes to stderr, prefixed "images:".
#
# Needs root on Debian or Ubuntu; buildah and debootstrap are apt-installed when missing (ctr,
# from the containerd package, for import). With Docker you need none of this:
#   docker build -f Dockerfile.runtime -t ghcr.io/goodput-dev/goodput-runtime:0.1.0 \
#     --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#   docker build -f Dockerfile.operator -t ghcr.io/goodput-dev/goodput-operator:0.1.0 .
#
# Caching, all under ${GOODPUT_CACHE:-${XDG_CACHE_HOME:-~/.cache}/goodput}:
#   base-<suite>-<BASE_VERSION>/rootfs.tar   the debootstrap root file system (180 MB);
#       bump BASE_VERSION below when the base's recipe changes. The base image is rebuilt only
#       when it is missing or was made from another rootfs.tar (label org.goodput.base).
#   images/<name>-<image id>.tar             the archives imported into containerd (1.3 GB for
#       the runtime, 0.35 GB for the operator); only the newest per image is kept.
#   An image is rebuilt only when the hash of its inputs (Dockerfile, .dockerignore, the files
#   it copies, the base image's id, the pip settings passed in) differs from its label
#   org.goodput.inputs; buildah's layer cache (--layers) keeps the dependency layer across
#   changes to the sources alone. An import is skipped when containerd's image carries the
#   label org.goodput.image-id with the image's current id.
#
# pip inside the build uses this machine's pip settings: index-url, extra-index-url and
# find-links are read from the environment (PIP_*) or `pip config`, passed as build args, and the
# local folders they name are mounted read-only at the same paths (buildah bud --volume). This is
# how torch==2.13.0 resolves to the local 2.13.0+cpu wheel (a local version sorts above PyPI's
# CUDA 2.13.0) and no CUDA packages are downloaded.
#
# buildah settings that work on a Debian bookworm VM (cgroup v1, ext4 root, buildah 1.28):
#   storage driver overlay (buildah's default; Native Overlay Diff: true on ext4). Where
#     /var/lib/containers sits on overlayfs itself (inside a container) run with
#     STORAGE_DRIVER=vfs, which buildah reads from the environment.
#   --isolation chroot: RUN steps need no runc, no cgroups and no network namespace, so they
#     reach PyPI and the Debian mirror like the host does. The default (oci, runc) worked on that
#     VM too, host network included; chroot is kept as it also works where runc cannot create
#     namespaces or cgroups (nested in a container). Override: BUILDAH_ISOLATION=oci.
#   --format docker: keeps Dockerfile.runtime's HEALTHCHECK (OCI images have none).
#
# Environment: GOODPUT_CACHE, DEBIAN_MIRROR (default http://deb.debian.org/debian),
# CONTAINERD_ADDRESS (default socket for import), CONTAINERD_SNAPSHOTTER (ctr's own),
# BUILDAH_ISOLATION, STORAGE_DRIVER, GOODPUT_IMAGES_FORCE=1 (rebuild and reimport regardless).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUITE=bookworm
# The base's recipe version: bump it when BASE_PACKAGES or make_rootfs changes.
BASE_VERSION=1
BASE_PACKAGES=python3,python3-pip,ca-certificates,passwd
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE_ROOT="${GOODPUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/goodput}"
BASE_DIR="$CACHE_ROOT/base-$SUITE-$BASE_VERSION"
ARCHIVES="$CACHE_ROOT/images"
BASE_IMAGE="localhost/goodput-base:$SUITE"
# the project's version, in one place (pyproject.toml repeats it, held equal by a unit test)
VERSION="$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' "$ROOT/contract/goodput_contract/version.py" | head -n1)"
VERSION="${VERSION:-0.1.0}"
RUNTIME_IMAGE="ghcr.io/goodput-dev/goodput-runtime:$VERSION"
OPERATOR_IMAGE="ghcr.io/goodput-dev/goodput-operator:$VERSION"
ISOLATION="${BUILDAH_ISOLATION:-chroot}"
SOCKET="${CONTAINERD_ADDRESS:-/run/containerd/containerd.sock}"
FORCE="${GOODPUT_IMAGES_FORCE:-0}"
# Part of every image's input hash: bump it when the build recipe here changes.
RECIPE=1

log() { echo "images: $*" >&2; }
die() { log "error: $*"; exit 1; }

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# step NAME COMMAND...: runs COMMAND, logging its name and how long it took.
step() {
  local name="$1" t0
  shift
  t0="$(now)"
  log "$name ..."
  "$@"
  log "$name: done in $(since "$t0")s"
}

# usage 0: the whole header above, on stderr; usage (an error): the commands only, exit 2.
usage() {
  if [[ "${1:-2}" == 0 ]]; then
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
  else
    sed -n '5,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}/images: usage: /' >&2
  fi
  exit "${1:-2}"
}

# ---------------------------------------------------------------- requirements

apt_updated=0
apt_install() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  log "installing ${missing[*]}"
  if [[ $apt_updated -eq 0 ]]; then apt-get update -qq >&2; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

check_host() {
  local os=""
  # shellcheck disable=SC1091
  [[ -r /etc/os-release ]] && os=" $(. /etc/os-release && echo "${ID:-} ${ID_LIKE:-}") "
  if [[ $(id -u) -ne 0 || ( "$os" != *" debian "* && "$os" != *" ubuntu "* ) ]]; then
    die "this script needs root on Debian or Ubuntu (it runs apt-get, debootstrap and buildah as root).
images: elsewhere, build with Docker instead, e.g.
images:   docker build -f Dockerfile.runtime -t $RUNTIME_IMAGE --build-arg BASE_IMAGE=python:3.11-slim-bookworm --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
images:   docker build -f Dockerfile.operator -t $OPERATOR_IMAGE ."
  fi
  apt_install buildah debootstrap
  command -v buildah >/dev/null || die "buildah is not installed (apt-get install buildah)"
}

# ---------------------------------------------------------------- base

# Image id, or nothing when there is no such image.
image_id() { buildah inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null || true; }
# The value of one label of a local image, or nothing.
image_label() {
  buildah inspect --type image --format "{{index .OCIv1.Config.Labels \"$2\"}}" "$1" 2>/dev/null || true
}

# Unmounts whatever debootstrap left mounted under $1 (after a failure), deepest first.
unmount_under() {
  local m
  awk -v d="$1/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do
    umount -l "$m" || true
  done
}

make_rootfs() {
  local tmp="$BASE_DIR/rootfs.tmp"
  mkdir -p "$BASE_DIR"
  unmount_under "$tmp"
  rm -rf --one-file-system "$tmp" "$BASE_DIR/rootfs.tar.tmp"
  trap 'unmount_under "'"$tmp"'"' EXIT
  log "debootstrap --variant=minbase --include=$BASE_PACKAGES $SUITE from $MIRROR"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$tmp" "$MIRROR" >&2 \
    || { tail -n 20 "$tmp/debootstrap/debootstrap.log" >&2 2>/dev/null || true; die "debootstrap failed"; }
  trap - EXIT
  # Like python:3.11-slim: pip may install into the system Python (no PEP 668 marker), no apt
  # lists, docs or logs. The sources keep updates and security for images that apt-get install.
  rm -f "$tmp"/usr/lib/python3*/EXTERNALLY-MANAGED
  rm -rf "$tmp"/var/lib/apt/lists/* "$tmp"/var/cache/apt/*.bin "$tmp"/var/cache/apt/archives/*.deb \
    "$tmp"/usr/share/doc/* "$tmp"/usr/share/man/* "$tmp"/usr/share/info/* \
    "$tmp"/var/log/*.log "$tmp"/var/log/apt/* "$tmp"/var/cache/debconf/*-old "$tmp"/etc/hostname
  : >"$tmp/etc/resolv.conf"
  cat >"$tmp/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
  chroot "$tmp" python3 -m pip --version >&2
  tar --numeric-owner --xattrs --sort=name -C "$tmp" -cf "$BASE_DIR/rootfs.tar.tmp" .
  sha256sum "$BASE_DIR/rootfs.tar.tmp" | cut -c1-64 >"$BASE_DIR/rootfs.tar.sha256"
  mv "$BASE_DIR/rootfs.tar.tmp" "$BASE_DIR/rootfs.tar"
  rm -rf --one-file-system "$tmp"
  log "rootfs: $(du -h "$BASE_DIR/rootfs.tar" | cut -f1)"
}

base_image() {
  if [[ ! -s "$BASE_DIR/rootfs.tar" || ! -s "$BASE_DIR/rootfs.tar.sha256" ]]; then
    step "base: debootstrap $SUITE" make_rootfs
  else
    log "base: cached rootfs $BASE_DIR/rootfs.tar"
  fi
  local want
  want="$SUITE-$BASE_VERSION-$(cut -c1-16 "$BASE_DIR/rootfs.tar.sha256")"
  if [[ "$FORCE" != 1 && "$(image_label "$BASE_IMAGE" org.goodput.base)" == "$want" ]]; then
    log "base: $BASE_IMAGE is up to date ($want)"
    return 0
  fi
  cat >"$BASE_DIR/Containerfile" <<'EOF'
# made by hack/images.sh: a debootstrap minbase with python3, pip, ca-certificates and useradd
FROM scratch
ADD rootfs.tar /
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8
CMD ["python3"]
EOF
  step "base: buildah bud $BASE_IMAGE" \
    buildah bud --quiet --isolation "$ISOLATION" --format docker --label "org.goodput.base=$want" \
      -f "$BASE_DIR/Containerfile" -t "$BASE_IMAGE" "$BASE_DIR" >/dev/null
}

# ---------------------------------------------------------------- build

# pip's setting $1 (index-url, extra-index-url, find-links) as pip would see it on this machine.
pip_setting() {
  local env="PIP_${1//-/_}" value=""
  env="${env^^}"
  if [[ -n "${!env:-}" ]]; then
    value="${!env}"
  else
    local scope
    for scope in global install; do
      value="$(python3 -m pip config get "$scope.$1" 2>/dev/null || true)"
      [[ -n "$value" ]] && break
    done
  fi
  echo "$value" | tr -s ' \t\n' ' ' | sed 's/^ //; s/ $//'
}

# Fills PIP_ARGS with --build-arg/--volume options passing this machine's pip settings on:
# index-url, extra-index-url and find-links, with the local folders they name mounted read-only
# at the same paths (for a file:// index .../simple the folder above it, as the index's links
# point next to it, ../../files/); and cert, the CA bundle pip trusts here (a TLS-inspecting
# proxy's CA, say), mounted over the image's own bundle for the RUN steps only. MOUNTS lists
# the mount points, which tidy_mountpoints removes from the image when buildah left them empty.
CERT_MOUNT=/etc/ssl/certs/ca-certificates.crt
PIP_ARGS=()
MOUNTS=()
pip_args() {
  PIP_ARGS=()
  MOUNTS=()
  local setting value entry dir kept mounted=" " name
  for setting in index-url extra-index-url find-links; do
    value="$(pip_setting "$setting")"
    [[ -n "$value" ]] || continue
    kept=()
    for entry in $value; do
      dir=""
      case "$entry" in
        file://*) dir="${entry#file://}" ;;
        /*) dir="$entry" ;;
      esac
      if [[ -n "$dir" ]]; then
        dir="${dir%/}"
        [[ -d "$dir" ]] || { log "pip $setting: $entry is not a folder here, left out"; continue; }
        [[ "$setting" != find-links && "${dir##*/}" == simple ]] && dir="${dir%/*}"
        [[ "$mounted" == *" $dir "* ]] || { PIP_ARGS+=(--volume "$dir:$dir:ro"); MOUNTS+=("$dir"); }
        mounted+="$dir "
      fi
      kept+=("$entry")
    done
    [[ ${#kept[@]} -gt 0 ]] || continue
    name="PIP_${setting//-/_}"
    PIP_ARGS+=(--build-arg "${name^^}=${kept[*]}")
  done
  value="$(pip_setting cert)"
  if [[ -n "$value" && -f "$value" ]]; then
    PIP_ARGS+=(--volume "$(readlink -f "$value"):$CERT_MOUNT:ro" --build-arg "PIP_CERT=$CERT_MOUNT")
    MOUNTS+=("$CERT_MOUNT")
  fi
}

# buildah bud --volume leaves each mount point behind in the image, empty (/opt/wheels, ...):
# removes those (and parents they leave empty) in one more layer, keeping config and labels.
tidy_mountpoints() {
  local image="$1" c m path gone=()
  [[ ${#MOUNTS[@]} -gt 0 ]] || return 0
  c="$(buildah from --quiet --pull=never "$image")"
  m="$(buildah mount "$c")"
  for path in "${MOUNTS[@]}"; do
    if [[ -f "$m$path" && ! -s "$m$path" ]]; then
      rm -f "$m$path"; gone+=("$path")
    elif [[ -d "$m$path" ]] && rmdir "$m$path" 2>/dev/null; then
      gone+=("$path")
    else
      continue
    fi
    path="${path%/*}"
    while [[ -n "$path" ]] && rmdir "$m$path" 2>/dev/null; do gone+=("$path"); path="${path%/*}"; done
  done
  buildah umount "$c" >/dev/null
  if [[ ${#gone[@]} -gt 0 ]]; then
    log "build: removing the empty mount points ${gone[*]}"
    buildah commit --quiet --format docker --rm "$c" "$image" >/dev/null
  else
    buildah rm "$c" >/dev/null
  fi
}

# Hash of everything an image is built from.
inputs_hash() {
  local which="$1" src="$2"
  (
    echo "recipe=$RECIPE base=$(image_id "$BASE_IMAGE") isolation=$ISOLATION"
    printf '%s\n' "${PIP_ARGS[@]}"
    cd "$ROOT"
    # the build context as .dockerignore leaves it for this image: pyproject.toml, README.md, $src/
    find "Dockerfile.$which" .dockerignore pyproject.toml README.md "$src" -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' -print0 \
      | LC_ALL=C sort -z | xargs -0 sha256sum
  ) | sha256sum | cut -c1-64
}

build_one() {
  local which="$1" image src hash t0
  case "$which" in
    runtime) image="$RUNTIME_IMAGE"; src=runtime ;;
    operator) image="$OPERATOR_IMAGE"; src=operator ;;
    *) die "unknown image '$which' (runtime, operator or all)" ;;
  esac
  hash="$(inputs_hash "$which" "$src")"
  if [[ "$FORCE" != 1 && "$(image_label "$image" org.goodput.inputs)" == "$hash" ]]; then
    log "build $which: $image is up to date (inputs ${hash:0:12}), skipped"
    echo "$image"
    return 0
  fi
  t0="$(now)"
  log "build $which: $image (inputs ${hash:0:12}) ..."
  buildah bud --layers --isolation "$ISOLATION" --format docker \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" "${PIP_ARGS[@]}" \
    --label "org.goodput.inputs=$hash" \
    -f "$ROOT/Dockerfile.$which" -t "$image" "$ROOT" >&2
  tidy_mountpoints "$image"
  log "build $which: done in $(since "$t0")s, $(buildah images --format '{{.Size}}' "$image" | head -n1)"
  echo "$image"
}

build() {
  local which="${1:-all}"
  [[ -n "$(image_id "$BASE_IMAGE")" ]] || base_image
  pip_args
  case "$which" in
    all) build_one operator; build_one runtime ;;
    *) build_one "$which" ;;
  esac
}

# ---------------------------------------------------------------- import

# The docker-archive of image $1 (id $2) that import reads, written when missing; prints its path.
archive_one() {
  local image="$1" id="$2" name archive
  name="${image##*/}"; name="${name%%:*}"
  archive="$ARCHIVES/$name-${id:0:12}.tar"
  mkdir -p "$ARCHIVES"
  if [[ ! -s "$archive" ]]; then
    find "$ARCHIVES" -maxdepth 1 -name "$name-*.tar*" -delete
    step "archive: buildah push $image" buildah push --quiet "$image" "docker-archive:$archive.tmp:$image" >&2
    mv "$archive.tmp" "$archive"
  fi
  echo "$archive"
}

# Builds both images and writes their archives: everything import does but the import itself, so a
# test session can run it beside other tests and leave its cluster tier only containerd's import.
prepare_all() {
  local image id
  build all
  for image in "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"; do
    id="$(image_id "$image")"
    [[ -n "$id" ]] || die "no image $image after the build"
    archive_one "$image" "$id" >/dev/null
  done
}

import_one() {
  local image="$1" id archive
  id="$(image_id "$image")"
  [[ -n "$id" ]] || die "no image $image: run hack/images.sh build first"
  if [[ "$FORCE" != 1 ]] && ctr -n k8s.io --address "$SOCKET" images ls "name==$image" 2>/dev/null \
      | grep -q "org.goodput.image-id=$id"; then
    log "import: containerd already has $image (${id:0:12}), skipped"
    echo "$image"
    return 0
  fi
  archive="$(archive_one "$image" "$id")"
  step "import: ctr images import $image ($(du -h "$archive" | cut -f1))" \
    ctr -n k8s.io --address "$SOCKET" images import "$archive" >&2
  ctr -n k8s.io --address "$SOCKET" images label "$image" "org.goodput.image-id=$id" >/dev/null
  echo "$image"
}

import_all() {
  command -v ctr >/dev/null || die "ctr not found: install containerd (hack/cluster.sh does)"
  [[ -S "$SOCKET" ]] || die "no containerd socket at $SOCKET: start containerd, or pass --containerd-socket PATH (or set CONTAINERD_ADDRESS)"
  ctr --address "$SOCKET" version >/dev/null 2>&1 || die "containerd at $SOCKET does not answer"
  import_one "$OPERATOR_IMAGE"
  import_one "$RUNTIME_IMAGE"
}

# ---------------------------------------------------------------- main

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
target=all
while [[ $# -gt 0 ]]; do
  case "$1" in
    --containerd-socket) [[ $# -ge 2 ]] || usage; SOCKET="$2"; shift 2 ;;
    --containerd-socket=*) SOCKET="${1#*=}"; shift ;;
    runtime|operator|all) [[ "$cmd" == build ]] || usage; target="$1"; shift ;;
    -h|--help) usage 0 ;;
    *) usage ;;
  esac
done

case "$cmd" in
  base|build|import|all|prepare) ;;
  names) printf '%s\n' "$BASE_IMAGE" "$RUNTIME_IMAGE" "$OPERATOR_IMAGE"; exit 0 ;;
  -h|--help|help) usage 0 ;;
  *) usage ;;
esac

check_host
mkdir -p "$CACHE_ROOT"
# one run at a time per cache (tests may call this concurrently)
exec 9>"$CACHE_ROOT/images.lock"
flock 9

t_all="$(now)"
case "$cmd" in
  base) step "base" base_image ;;
  build) build "$target" ;;
  import) import_all ;;
  all) step "base" base_image; build all; import_all ;;
  prepare) step "base" base_image; prepare_all ;;
esac
log "$cmd: all done in $(since "$t_all")s"
