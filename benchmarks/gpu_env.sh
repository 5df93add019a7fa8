# Sourced by the GPU stage scripts (benchmarks/gpu.sh, scripts/gpu_mainjob.sh) from the checkout's
# root: Python packages a GPU machine lacks (jsonargparse, mlflow, liger-kernel, ...) travel as
# wheels in $WHEELS (default .whl) and are installed into /tmp/site, once per machine (a warm
# machine's next call, or the next script of the same call, finds them there); tandem_lit is
# imported from this checkout, installed or not.
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  installed=$(ls "$WHEELS"/*.whl | xargs -n1 basename | sort | md5sum | cut -c1-32)
  if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
      || { echo "installing $WHEELS failed"; exit 1; }
    echo "$installed" > /tmp/site/.wheels
  fi
  export PYTHONPATH=/tmp/site:$PWD
elif [ -f /tmp/site/.wheels ]; then  # a warm machine's later call that did not carry them again
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
