#!/usr/bin/env bash
# The checks and figures that need a CUDA GPU, in one run (CI has no GPU; run this where one is):
#   hack/gpu-checks.sh [STEP...]      (default: env normtests gemvstep compiled gputests serve, about 8 minutes on
#                                      an H200, within a 15-minute lease; `all` runs every step, about 25 minutes)
# (steps: env tests (gputests: without the kernels' cases) attention gemv gemvtests normtests lora gemvstep decode compiled profile exact
#  fp8 serve spec spec32; GEMV_VARIANTS names gemvstep's variants)
# Each step has its own time limit; every step's log goes into $OUT/steps.log (default _output/gpu), its JSON beside;
# a failed step is reported and the next one still runs. Python packages the machine lacks may be
# put as wheels in .whl/ (installed into /tmp/site first; the device machine lacks llguidance and jsonschema:
#   pip download llguidance --no-deps --only-binary :all: --platform manylinux_2_28_x86_64 -d .whl
#   pip download jsonschema --only-binary :all: --platform manylinux_2_28_x86_64 --python-version 3.12 -d .whl
# and pass carry [".whl"]).
set -u
OUT=${OUT:-_output/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed"
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$ROOT/runtime:$ROOT/operator:$ROOT/contract:$ROOT/gateway:$ROOT:${PYTHONPATH:-}
MODEL=${GPU_MODEL:-/tmp/llama-1b}
STEPS=${*:-env normtests gemvstep compiled gputests serve}
[ "$STEPS" = all ] && STEPS="env tests attention gemv lora gemvstep decode compiled profile exact fp8 serve spec spec32"
declare -A RESULT

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  echo "=== $name (limit ${limit}s)"
  mkdir -p /tmp/gpu-logs
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >"/tmp/gpu-logs/$name.log" 2>&1
  local rc=$?
  RESULT[$name]="rc=$rc $((SECONDS - started))s"
  { echo "=== $name: ${RESULT[$name]}"; cat "/tmp/gpu-logs/$name.log"; } >>"$OUT/steps.log"  # one file: few come back
  tail -n 25 "/tmp/gpu-logs/$name.log"
  echo "=== $name: ${RESULT[$name]}"
}

need_model() {
  [ -f "$MODEL/model.safetensors" ] || [ -f "$MODEL/model.safetensors.index.json" ] \
    || python3 -m goodput_runtime.tools.make_model --out "$MODEL" --shape 1b --dtype bfloat16
}

env_report() {
  nvidia-smi
  python3 - <<'EOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
p = torch.cuda.get_device_properties(0)
print(p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs", "capability", p.major, p.minor)
# the copy ceiling: bytes read plus written by one large device-to-device copy, median of 20
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
times = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); b.synchronize(); times.append(a.elapsed_time(b) / 1e3)
times.sort()
print(f"device-to-device copy: {2 * x.numel() / times[10] / 1e12:.2f} TB/s (read + written)")
EOF
}

serve_smoke() {
  # shellcheck disable=SC2086  # GPU_SERVE_ARGS holds several flags, split on purpose
  python3 -m goodput_runtime --model "$MODEL" --served-model-name llama-1b --device "${GPU_DEVICE:-cuda}" --dtype "${GPU_DTYPE:-bfloat16}" \
    --max-model-len 1024 --port 18080 ${GPU_SERVE_ARGS:-} >/tmp/gpu-logs/serve-server.log 2>&1 &
  local pid=$!
  for _ in $(seq 180); do curl -sf localhost:18080/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  curl -sf localhost:18080/v1/models || { tail -n 40 /tmp/gpu-logs/serve-server.log; kill $pid; return 1; }
  echo
  curl -sS -N localhost:18080/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"llama-1b","messages":[{"role":"user","content":"Hello there"}],"max_tokens":8,"stream":true,"temperature":0}'
  echo
  # 32 concurrent streams of 64 tokens: every one must finish with a length stop
  python3 - <<'EOF'
import concurrent.futures, json, time, urllib.request
def one(i):
    body = json.dumps({"model": "llama-1b", "prompt": f"request {i} " * 20, "max_tokens": 64,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request("http://localhost:18080/v1/completions", body, {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))
started = time.time()
with concurrent.futures.ThreadPoolExecutor(32) as pool:
    results = list(pool.map(one, range(32)))
elapsed = time.time() - started
tokens = sum(r["usage"]["completion_tokens"] for r in results)
print(f"32 concurrent completions: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.0f} tok/s; "
      f"finish reasons {sorted({c['finish_reason'] for r in results for c in r['choices']})}")
assert tokens == 32 * 64
EOF
  local rc=$?
  curl -sf localhost:18080/metrics | grep -E "^goodput_" | grep -v _bucket | head -30
  kill $pid; wait $pid
  tail -n 30 /tmp/gpu-logs/serve-server.log
  return $rc
}

export -f need_model env_report serve_smoke
export MODEL OUT
for s in $STEPS; do
  case $s in gemvstep|decode|compiled|profile|exact|fp8|serve|spec|spec32) [ -n "${RESULT[model]:-}" ] || step model 300 need_model ;; esac
  case $s in
    env) step env 120 env_report ;;
    # the engine-level GPU tests first (a dozen; only the files that hold some, as the others import the
    # HTTP stack this machine may lack), then the Triton kernels' per-shape cases (over a
    # hundred, each compiled afresh: minutes), so a short limit still checks the engine
    tests|gputests)
      # shellcheck disable=SC2046  # one argument per file that holds gpu tests
      step tests 300 python3 -m pytest -m gpu $(grep -l "mark.gpu" tests/runtime/test_*.py) -q -p no:cacheprovider -p no:logging \
      --tb=short -rfEs
      [ "$s" = gputests ] || step kernels 420 python3 -m pytest -m "runtime and not gpu" tests/runtime/test_triton_attention.py \
      tests/runtime/test_triton_linear.py -q -p no:cacheprovider -p no:logging --tb=short -rfEs ;;
    attention) step attention 180 python3 -m bench.gpu_attention --out "$OUT/gpu_attention.json" ;;
    gemv) step gemv 150 python3 -m bench.gpu_gemv --out "$OUT/gpu_gemv.json" ;;
    gemvstep) step gemvstep 300 python3 -m bench.gpu_profile --model "$MODEL" --batch-sizes 1 \
      --variants "${GEMV_VARIANTS:-triton+compile,triton+compile+attnpdl,triton+compile+nopdl,triton,triton+attnpdl}" \
      --out "$OUT/gpu_profile_gemv.json" ;;
    # the GEMV's folded norm, compiled for the GPU in every dtype
    normtests) step normtests 180 python3 -m pytest tests/runtime/test_triton_linear.py -k norm -q -p no:cacheprovider \
      -p no:logging --tb=short -rfEs ;;
    # the GEMV's own tests, every kernel case compiled, and the engine's CUDA-graph tests it serves in
    gemvtests)
      # shellcheck disable=SC2016  # the script is expanded by the inner bash
      step gemvtests 300 bash -c 'q="-q -p no:cacheprovider -p no:logging --tb=short -rfEs"
      python3 -m pytest tests/runtime/test_triton_linear.py $q; a=$?
      python3 -m pytest -m gpu tests/runtime/test_decode_graphs.py tests/runtime/test_spec_decode.py $q; exit $((a | $?))' ;;
    # the LoRA shrink/expand kernels compiled (float32, bf16, fp16 against the torch paths) and an engine's
    # steps with adapters through them
    lora) step lora 300 python3 -m pytest -m gpu tests/runtime/test_triton_lora_kernel.py -q -p no:cacheprovider \
      -p no:logging --tb=short -rfEs ;;
    decode) step decode 480 python3 -m bench.gpu_decode --model "$MODEL" --out "$OUT/gpu_decode.json" ;;
    compiled) step compiled 420 python3 -m bench.gpu_decode --model "$MODEL" --compile \
      --out "$OUT/gpu_decode_compiled.json" ;;
    profile) step profile 360 python3 -m bench.gpu_profile --model "$MODEL" --out "$OUT/gpu_profile.json" ;;
    exact) step exact 240 python3 -m bench.gpu_decode --model "$MODEL" --dtype float32 --batch-sizes 1,16 \
      --rounds 1 --steps 64 --out "$OUT/gpu_decode_fp32.json" ;;
    fp8) step fp8 300 python3 -m bench.gpu_decode --model "$MODEL" --quantization fp8 --rounds 2 \
      --out "$OUT/gpu_decode_fp8.json" ;;
    serve) step serve 300 serve_smoke ;;
    spec) step spec 300 python3 -m bench.spec_decode --device cuda --dtype bfloat16 --model "$MODEL" --rounds 2 \
      --output "$OUT/spec_decode_gpu.json" ;;
    spec32) step spec32 300 python3 -m bench.spec_decode --device cuda --dtype float32 --model "$MODEL" --rounds 1 \
      --configs baseline,ngram-k3 --output "$OUT/spec_decode_gpu_fp32.json" ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "=== summary"
for s in $STEPS; do echo "$s: ${RESULT[$s]:-not run}"; done
[ -z "${RESULT[kernels]:-}" ] || echo "kernels (with tests): ${RESULT[kernels]}"
