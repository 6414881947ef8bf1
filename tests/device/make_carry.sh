#!/usr/bin/env bash
# What the device checks (nccl_check.sh, compute_check.sh) need on a GPU machine that has torch
# but no network:
#   .whl/      wheels (x86-64) of the study's packages that machine lacks, for ITS Python:
#              DEVICE_PYTHON (default 3.12, the device machine's python3), whatever Python runs
#              here; .whl/python-version names it and carried_packages.sh refuses another
#   .gpudata/  the first 8000 training images of Debian's Fashion-MNIST, and its test set
# Both are git-ignored (.git/info/exclude) and travel as the device tool's `carry`. The wheels
# come from this machine's package index (pip's configured index and find-links).
#   bash tests/device/make_carry.sh                     # for Python 3.12
#   DEVICE_PYTHON=3.13 bash tests/device/make_carry.sh  # for a machine whose python3 is 3.13
set -euo pipefail
cd "$(dirname "$0")/../.."
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
for path in /.whl/ /.gpudata/; do grep -qx "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude; done
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
scratch=$(mktemp -d)
pip wheel -q --no-deps -w "$scratch" connection_pool==0.0.3  # an sdist only; pure Python
python3 -m pip download -q --find-links "$scratch" --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
    $platforms -d "$scratch" mlflow==3.17.2 submitit==1.5.4 snakemake==9.27.1 sqlalchemy==2.0.58
# already on the machine (its image's package list), and pulp (only snakemake's ILP
# scheduler imports it; the check runs --scheduler greedy)
present="absl_py aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attrs certifi charset_normalizer click
cloudpickle contourpy cycler filelock fonttools frozenlist fsspec h11 idna jinja2 joblib kiwisolver markupsafe
matplotlib multidict narwhals numpy packaging pandas pillow propcache protobuf psutil pyarrow pyparsing
python_dateutil pyyaml requests scikit_learn scipy six tabulate threadpoolctl typing_extensions urllib3 werkzeug
wrapt yarl zipp pulp"
rm -rf .whl && mkdir .whl
for wheel in "$scratch"/*.whl; do
    name=$(basename "$wheel" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_')
    [[ " $(echo $present) " == *" $name "* ]] || cp "$wheel" .whl/
done
rm -rf "$scratch"
echo "$DEVICE_PYTHON" > .whl/python-version
mkdir -p .gpudata/fashion-mnist
python3 - <<'PY'
import gzip, shutil, struct
src, dst, count = "/usr/share/datasets/fashion-mnist/", ".gpudata/fashion-mnist/", 8000
for kind, header, item in (("images-idx3", b"\x00\x00\x08\x03", 784), ("labels-idx1", b"\x00\x00\x08\x01", 1)):
    with gzip.open(f"{src}train-{kind}-ubyte.gz") as f:
        f.read(16 if item > 1 else 8)
        data = f.read(count * item)
    dims = struct.pack(">III", count, 28, 28) if item > 1 else struct.pack(">I", count)
    with gzip.open(f"{dst}train-{kind}-ubyte.gz", "wb") as g:
        g.write(header + dims + data)
    shutil.copy(f"{src}t10k-{kind}-ubyte.gz", dst)
PY
du -sh .whl .gpudata
