# Sourced by the device checks (nccl_check.sh, compute_check.sh), from the repository root:
# the packages the GPU machine lacks, carried as wheels in .whl/ (make_carry.sh; no network
# there), installed into /tmp/site, and the study's package on PYTHONPATH.
#   use_carried_packages LOG_DIR
use_carried_packages() {
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            > "$1/install.log" 2>&1 || { tail -20 "$1/install.log"; return 1; }
        export PYTHONPATH=/tmp/site:$PWD/workflow PATH=/tmp/site/bin:$PATH
    else
        export PYTHONPATH=$PWD/workflow
    fi
}
