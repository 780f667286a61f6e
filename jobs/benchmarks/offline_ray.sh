#!/usr/bin/env bash
# Ray and the few packages a bare GPU image lacks, packed for a machine with no network (gpu.sh's OFFLINE):
#
#     bash jobs/benchmarks/offline_ray.sh DIR        # then: OFFLINE=DIR bash jobs/benchmarks/gpu.sh OUT ITEM...
#
# DIR/ray.tar.xz is Ray's wheel for that image's Python (PY, 3.12) unpacked without ray/jars and
# ray/dashboard/client/build (Java, the dashboard's web pages): 30 MB against the wheel's 79. DIR/whl holds
# the wheels of what Ray and the jobs import that such an image lacks, at constraints.txt's versions.
# Unpacked with unzip, which keeps the executable bits: Python's zipfile drops them, and Ray's gcs_server
# then fails to start ("Permission denied").
set -euo pipefail
dir=${1:?usage: bash jobs/benchmarks/offline_ray.sh DIR}
py=${PY:-3.12}
pin() { grep -i "^$1==" "$(dirname "$0")/../../constraints.txt"; }
get() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$@"
}
mkdir -p "$dir/whl" "$dir/.wheel"
names=(jsonschema referencing rpds-py jsonschema-specifications pydantic pydantic_core annotated-types
    typing-inspection tensorboardX webdataset braceexpand)
get -d "$dir/whl" $(for n in "${names[@]}"; do pin "$n"; done)
get -d "$dir/.wheel" "$(pin ray)"
site=$(mktemp -d)
unzip -q "$dir"/.wheel/ray-*.whl -d "$site"
rm -rf "$site/ray/jars" "$site/ray/dashboard/client/build" "$dir/.wheel"
tar cJf "$dir/ray.tar.xz" -C "$site" .
rm -rf "$site"
du -sh "$dir/ray.tar.xz" "$dir/whl"
