#!/usr/bin/env bash
# Compile-only check of the CUDA kernels with nvcc (no GPU needed); exits non-zero on any error.
# CUDA_ARCH picks the target (sm_80); NVCC_EXTRA adds flags, such as "-Xptxas -v" for the
# kernels' register counts.
set -euo pipefail
csrc_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nvcc_bin="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
arch="${CUDA_ARCH:-sm_80}"
out_dir="$(mktemp -d)"
trap 'rm -rf "$out_dir"' EXIT
mapfile -t torch_flags < <(python - <<'PY'
from torch.utils import cpp_extension
for path in cpp_extension.include_paths():
    print(f"-I{path}")
for flag in cpp_extension.COMMON_NVCC_FLAGS:
    print(flag)
PY
)
# NOTE: CPU-only torch wheels omit this generated header; a CUDA build of torch defines just this.
stub_dir="$out_dir/include/c10/cuda/impl"
mkdir -p "$stub_dir"
echo "#define C10_CUDA_BUILD_SHARED_LIBS" > "$stub_dir/cuda_cmake_macros.h"
torch_flags+=("-I$out_dir/include")
"$nvcc_bin" -c "$csrc_dir/cuda/paged_attention.cu" -o "$out_dir/paged_attention.o" \
  -std=c++20 -O3 -arch="$arch" -Xcompiler -fPIC -Werror all-warnings \
  ${NVCC_EXTRA:-} "${torch_flags[@]}"
echo "nvcc compile OK ($arch)"
