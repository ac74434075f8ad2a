# Sourced by the scripts that run on a lent card (gpu-check.sh, gpu-trainers.sh): `carried_wheels DIR`
# installs the wheels carried in DIR (default .whl) offline into a site folder and puts it on
# PYTHONPATH, for the python in $PY. The card reaches no package index (docs/GPU.md).
carried_wheels() {
  local wheels=${1:-.whl}
  if compgen -G "$wheels/*.whl" >/dev/null; then
    local site=${TMPDIR:-/tmp}/rewardstack-site
    echo "installing $(ls "$wheels"/*.whl | wc -l) carried wheel(s) from $wheels/ into $site (--no-index)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
}
