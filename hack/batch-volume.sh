#!/usr/bin/env bash
# The Batch API's store where the cluster provisions no volumes (no default StorageClass), as on
# hack/cluster.sh's one-node cluster: a hostPath PersistentVolume in a folder of this machine (the
# node), owned by the gateway's user (65532), made for the claim goodput-gateway-batch (claimRef) that
# `kubectl apply -k manifests/` and the Helm chart create in the install's namespace.
#   hack/batch-volume.sh DIR [NAMESPACE]      NAMESPACE defaults to goodput-system
# Does nothing where a StorageClass is the default (kind, most clouds): that one provisions the claim.
# A volume left Released by a deleted claim is offered to the claim again (the batches stay in DIR).
# KUBECONFIG picks the cluster as usual; KUBECTL the kubectl.
set -euo pipefail
DIR="${1:?usage: $0 DIR [NAMESPACE]}"
NAMESPACE="${2:-goodput-system}"
KUBECTL="${KUBECTL:-kubectl}"
NAME=goodput-gateway-batch

defaults="$("$KUBECTL" get storageclass -o jsonpath='{range .items[*]}{.metadata.annotations.storageclass\.kubernetes\.io/is-default-class}{.metadata.annotations.storageclass\.beta\.kubernetes\.io/is-default-class}{"\n"}{end}')"
if grep -qx true <<<"$defaults"; then
  echo "a default StorageClass provisions the claim $NAMESPACE/$NAME; no volume made"
  exit 0
fi
mkdir -p "$DIR"
chown 65532:65532 "$DIR"
chmod 0700 "$DIR"
"$KUBECTL" apply -f - <<YAML
apiVersion: v1
kind: PersistentVolume
metadata:
  name: $NAME
  labels:
    app.kubernetes.io/name: goodput-gateway-batch
spec:
  capacity: {storage: 10Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  claimRef: {namespace: $NAMESPACE, name: $NAME}
  hostPath: {path: $DIR, type: Directory}
YAML
if [[ "$("$KUBECTL" get pv "$NAME" -o jsonpath='{.status.phase}')" == Released ]]; then
  "$KUBECTL" patch pv "$NAME" --type merge -p '{"spec": {"claimRef": {"uid": null, "resourceVersion": null}}}'
fi
