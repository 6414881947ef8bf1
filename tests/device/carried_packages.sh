# Sourced by the device checks (nccl_check.sh, compute_check.sh), from the repository root:
# the packages the GPU machine lacks, carried as wheels in .whl/ (make_carry.sh; no network
# there) for this machine's Python, installed into /tmp/site, and the study's package on PYTHONPATH.
#   use_carried_packages LOG_DIR
use_carried_packages() {
    # a machine that has them (this project's own set-up, a dry run) installs nothing
    if [ -d .whl ] && ! python3 -c "import mlflow, snakemake, submitit" 2>/dev/null; then
        local wanted here
        wanted=$(cat .whl/python-version 2>/dev/null || echo 3.12)
        here=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        if [ "$wanted" != "$here" ]; then
            echo "the wheels in .whl/ are for Python $wanted but python3 here is $here:" \
                 "run DEVICE_PYTHON=$here bash tests/device/make_carry.sh where pip has an index, and carry .whl again"
            return 1
        fi
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            > "$1/install.log" 2>&1 || { tail -20 "$1/install.log"; return 1; }
        export PYTHONPATH=/tmp/site:$PWD/workflow PATH=/tmp/site/bin:$PATH
    else
        export PYTHONPATH=$PWD/workflow
    fi
}
