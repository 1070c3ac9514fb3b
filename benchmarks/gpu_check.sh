#!/usr/bin/env bash
# The GPU check (issue 15): geotrain on a machine with a CUDA GPU, as one short script.
#
#   benchmarks/gpu_check.sh            # logs into $OUT, else ./gpu-check
#
# 1. tests/test_cuda.py: every algorithm and codec on CUDA tensors (2 ranks through gloo: NCCL
#    refuses two ranks on one GPU), each against the same run on the CPU; bf16 autocast; the
#    examples under NCCL with one process per GPU; the CLI's hosts on one GPU.
# 2. The suite's end-to-end modules (the CLI, the API and its examples, Hugging Face models),
#    which run on the GPU wherever one is visible.
# 3. The mini model's step on the GPU (fp32 and bf16 autocast), one worker under NCCL's set-up.
# 4. What int4's mean costs the GPU besides the link, owners=2's digests included
#    (benchmarks/gpu_codec_cost.py).
# Uses the machine's python3 and its torch (the pins are for CPU machines); needs pytest,
# pytest-timeout and pytest-xdist there, and blake3 and zfec (installed from the wheels in ./.whl
# where it holds them, for a machine without an index; from the index otherwise).
set -u -o pipefail
failed=0
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
workers=${WORKERS:-12}
for pkg in blake3 zfec; do
    whl=$(ls .whl/"$pkg"-*.whl 2>/dev/null | head -n 1)
    $py -c "import $pkg" 2>/dev/null || $py -m pip install -q --no-deps "${whl:-$pkg}"
done

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$out/env.txt"

echo "== tests/test_cuda.py"
timeout 260 $py -m pytest -q -p no:cacheprovider -n "$workers" --timeout 240 -rA tests/test_cuda.py \
    2>&1 | tail -n 60 | tee "$out/test_cuda.txt" || failed=1

echo "== end-to-end modules on the GPU"
timeout 120 $py -m pytest -q -p no:cacheprovider -n "$workers" --timeout 110 -rfE \
    tests/test_api.py tests/test_models.py tests/test_dreamddp_e2e.py \
    2>&1 | tail -n 80 | tee "$out/e2e.txt" || failed=1

echo "== mini on the GPU: steps of one worker"
for cast in off bf16; do
    timeout 45 $py -m geotrain run --workers 1 --no-netem --model mini --batch-size 8 --steps 60 \
        --algo nosync --autocast "$cast" --no-progress --run-dir "$out/mini-$cast" 2>&1 \
        | grep -E "step time|tokens/s|compute|error" | sed "s/^/$cast: /" | tee -a "$out/mini.txt"
done
echo "== int4's work per message on the GPU"
timeout 120 $py benchmarks/gpu_codec_cost.py 2>&1 | tee "$out/codec_cost.txt"
rm -rf "$out"/mini-*/  # their summaries are in mini.txt; $OUT takes files two folders deep
exit $failed  # the tests' verdict: 1 if either pytest run failed
