#!/usr/bin/env bash
# `kubectl apply -k manifests/` for every supported Kubernetes: servers older than 1.21 serve
# PodDisruptionBudgets only as policy/v1beta1, so there the rendered manifests say that instead.
#   hack/apply-manifests.sh [kubectl apply flags...]     e.g. --dry-run=server
# KUBECONFIG picks the cluster as usual; KUBECTL the kubectl (1.21 or newer, for kustomize).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KUBECTL="${KUBECTL:-kubectl}"
rendered="$("$KUBECTL" kustomize "$ROOT/manifests")"
if ! "$KUBECTL" api-versions 2>/dev/null | grep -qx 'policy/v1'; then
  # shellcheck disable=SC2001  # anchored at each line's start and end, which ${var//} cannot say
  rendered="$(sed 's#^apiVersion: policy/v1$#apiVersion: policy/v1beta1#' <<<"$rendered")"
fi
"$KUBECTL" apply "$@" -f - <<<"$rendered"
