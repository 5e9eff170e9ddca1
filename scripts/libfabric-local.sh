#!/usr/bin/env bash
# NIXL's LIBFABRIC backend (`--kv-transport efa`) on a machine without EFA devices, where libfabric's tcp
# provider carries it: for the efa cases of the transport and fault tests (docs/testing.md). NIXL 1.5.1's
# LIBFABRIC plugin asks for libfabric's ABI FABRIC_1.10, added after libfabric 2.6.0, which no distribution
# ships yet: this builds it from a libfabric source tree you provide (a clone of github.com/ofiwg/libfabric at
# a commit after v2.6.0), and puts beside it what the plugin also loads: hwloc 2 (Debian's libhwloc15),
# libcudart.so.12 (PyPI's nvidia-cuda-runtime-cu12) and our libcuda.so.1 stub (docker/libcuda-stub.c).
# Needs autoconf, automake, libtool and gcc (Debian packages).
#
#   scripts/libfabric-local.sh LIBFABRIC_SOURCE PREFIX
#   export LD_LIBRARY_PATH="$(cat PREFIX/ld_library_path)"
#   .venv/bin/pytest tests/integration/test_kv_transfer.py tests/integration/test_disagg_faults.py -k efa
set -euo pipefail
if [ $# -ne 2 ]; then
    echo "usage: $0 LIBFABRIC_SOURCE PREFIX" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
src=$(cd "$1" && pwd)
mkdir -p "$2"
prefix=$(cd "$2" && pwd)
mkdir -p "$prefix/build" "$prefix/deb" "$prefix/wheel" "$prefix/lib"

# libfabric, with the providers of a machine without RDMA devices (tcp, its rxm layer, shared memory)
(cd "$src" && ./autogen.sh)
(cd "$prefix/build" && "$src/configure" --prefix="$prefix" --enable-tcp --enable-rxm --enable-shm \
    --enable-sockets --disable-verbs --disable-efa --disable-psm2 --disable-psm3 --disable-usnic \
    --disable-opx --disable-cxi --disable-lpp --disable-ucx --disable-mrail --disable-perf --disable-sm2 \
    && make -j"$(nproc)" && make install) > "$prefix/build.log" 2>&1 || {
    tail -20 "$prefix/build.log" >&2
    exit 1
}
# hwloc 2 from Debian, unpacked here (nothing is installed on the machine)
(cd "$prefix/deb" && apt-get download libhwloc15 && dpkg -x libhwloc15_*.deb .)
# the CUDA runtime from PyPI, unpacked here
python3 -m pip download --no-deps --quiet nvidia-cuda-runtime-cu12==12.9.79 -d "$prefix/wheel"
(cd "$prefix/wheel" && python3 -m zipfile -e nvidia_cuda_runtime_cu12-*.whl .)
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$prefix/lib/libcuda.so.1" "$root/docker/libcuda-stub.c"

echo "$prefix/lib:$prefix/deb/usr/lib/x86_64-linux-gnu:$prefix/wheel/nvidia/cuda_runtime/lib" \
    > "$prefix/ld_library_path"
echo "done: export LD_LIBRARY_PATH=\"\$(cat $prefix/ld_library_path)\""
