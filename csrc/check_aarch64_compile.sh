#!/usr/bin/env bash
# Compile-only check of the CPU kernels for aarch64 with a cross-compiler (Debian's
# g++-aarch64-linux-gnu); exits non-zero on any error. They take their scalar paths there.
set -euo pipefail
csrc_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cxx="${CXX_AARCH64:-aarch64-linux-gnu-g++}"
out_dir="$(mktemp -d)"
trap 'rm -rf "$out_dir"' EXIT
mapfile -t torch_flags < <(python - <<'PY'
import sysconfig

from torch.utils import cpp_extension

for path in cpp_extension.include_paths():
    print(f"-I{path}")
print(f"-I{sysconfig.get_paths()['include']}")
PY
)
for source in "$csrc_dir"/torch_bindings.cpp "$csrc_dir"/cpu/*.cpp; do
  "$cxx" -c "$source" -o "$out_dir/$(basename "$source").o" \
    -std=c++20 -O2 -march=armv8-a -fopenmp -fPIC "${torch_flags[@]}"
done
echo "aarch64 compile OK ($("$cxx" -dumpfullversion))"
