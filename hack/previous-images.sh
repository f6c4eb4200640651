#!/usr/bin/env bash
# Builds the previous version's images, from that commit's own tree and its own hack/images.sh,
# under a tag of their own, and imports them into containerd: what the upgrade test installs
# before it upgrades to the working tree's version.
#
#   hack/previous-images.sh all [--containerd-socket PATH]   # build (cached) + import
#   hack/previous-images.sh build|import|names               # as hack/images.sh's commands
#   hack/previous-images.sh src                              # prints the commit's tree (exported)
#
# The previous version is GOODPUT_PREVIOUS (default 10decfb9^: the last commit installed with
# `kubectl apply -k manifests/` alone, before the Helm chart). Its images are tagged
#   ghcr.io/goodput-dev/goodput-runtime:prev-<commit, 7 hex digits>
#   ghcr.io/goodput-dev/goodput-operator:prev-<commit, 7 hex digits>
# so that they never replace the working tree's (which carry the same version number).
#
# The commit's tree is exported once (git archive, no worktree) to
#   ${GOODPUT_CACHE:-~/.cache/goodput}/previous/<commit>/src
# with one build fix where the tree needs it: a pyproject.toml that reads its version dynamically
# from contract/ (as 10decfb9^'s does) gets it written in statically, as later commits do, since
# the Dockerfiles install the dependencies from pyproject.toml alone, before contract/ is copied
# (the sources, Dockerfiles and manifests stay the commit's). Its hack/images.sh runs there with
# three lines changed: the two image names above and its archive folder (previous/<commit>/archives,
# so that the working tree's archives, which share the image names' stem, are not taken for stale
# ones and deleted). Everything else is that script's own: the shared Debian base, the input hashes
# that skip an unchanged build, the containerd label that skips an unchanged import, and the lock
# that serialises it with hack/images.sh.
#
# Needs the commit in this clone (a full clone has it; a shallow one: git fetch --unshallow), or its tree
# exported by an earlier run in the cache.
# stdout: the image names, one per line; progress on stderr, prefixed "previous-images:" (and
# "images:" from the commit's script).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REV="${GOODPUT_PREVIOUS:-10decfb9^}"
CACHE_ROOT="${GOODPUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/goodput}"

log() { echo "previous-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

# the default's commit, named in full: a machine that exported it once (its cache below) needs no history
DEFAULT_SHA=7e8074f8c5dc69d2ad79555afb90ccee371fa51c
if ! SHA="$(git -C "$ROOT" rev-parse --verify -q "$REV^{commit}" 2>/dev/null)"; then
  if [[ -z "${GOODPUT_PREVIOUS:-}" && -f "$CACHE_ROOT/previous/$DEFAULT_SHA/.exported" ]]; then
    SHA=$DEFAULT_SHA
    log "$REV is not in this clone; its tree exported before is in the cache"
  else
    die "commit $REV is not in this clone at $ROOT (a shallow clone? git fetch --unshallow)"
  fi
fi
TAG="prev-${SHA:0:7}"
DIR="$CACHE_ROOT/previous/$SHA"
SRC="$DIR/src"

# The commit's tree with its hack/images.sh retargeted; made once, marked complete by .exported.
export_tree() {
  [[ -f "$DIR/.exported" ]] && return 0
  log "exporting $REV ($SHA) to $SRC"
  rm -rf --one-file-system "$SRC"
  mkdir -p "$SRC"
  git -C "$ROOT" archive --format=tar "$SHA" | tar -x -C "$SRC"
  local pyproject="$SRC/pyproject.toml" version
  if grep -qxF 'dynamic = ["version"]' "$pyproject"; then
    version="$(sed -n 's/^VERSION = "\(.*\)"$/\1/p' "$SRC/contract/goodput_contract/version.py" | head -n1)"
    [[ -n "$version" ]] || die "$REV's pyproject.toml reads a version that contract/ does not hold"
    log "pyproject.toml: the version written in statically ($version): the Dockerfiles read that file alone"
    sed -i -e "s/^dynamic = \[\"version\"\]\$/version = \"$version\"/" \
      -e '/^\[tool\.setuptools\.dynamic\]$/,/^$/d' "$pyproject"
    grep -qxF "version = \"$version\"" "$pyproject" && ! grep -q 'setuptools\.dynamic' "$pyproject" \
      || die "could not write the version into $REV's pyproject.toml"
  fi
  local script="$SRC/hack/images.sh"
  [[ -x "$script" ]] || die "$REV has no hack/images.sh"
  sed -i \
    -e "s#^RUNTIME_IMAGE=.*#RUNTIME_IMAGE=\"ghcr.io/goodput-dev/goodput-runtime:$TAG\"#" \
    -e "s#^OPERATOR_IMAGE=.*#OPERATOR_IMAGE=\"ghcr.io/goodput-dev/goodput-operator:$TAG\"#" \
    -e "s#^ARCHIVES=.*#ARCHIVES=\"$DIR/archives\"#" \
    "$script"
  local want
  for want in "RUNTIME_IMAGE=\"ghcr.io/goodput-dev/goodput-runtime:$TAG\"" \
      "OPERATOR_IMAGE=\"ghcr.io/goodput-dev/goodput-operator:$TAG\"" "ARCHIVES=\"$DIR/archives\""; do
    grep -qxF "$want" "$script" || die "$REV's hack/images.sh has no line to set $want"
  done
  touch "$DIR/.exported"
}

case "${1:-}" in
  all|build|import|names) ;;
  src) export_tree; echo "$SRC"; exit 0 ;;
  *) sed -n '6,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}/previous-images: usage: /' >&2; exit 2 ;;
esac
export_tree
GOODPUT_CACHE="$CACHE_ROOT" exec "$SRC/hack/images.sh" "$@"
