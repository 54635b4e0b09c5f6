#!/usr/bin/env bash
# Builds (or reuses) the venv in which the contract test imports the REAL FreeToken
# 0.2.1 argument parser (freetoken/server/args.py, parse_args) on a machine without a
# GPU. Usage: bash tests/contract/setup_real_parser.sh
#
# Only what the parser's import chain needs goes in, not freetoken's whole dependency
# list:
#   torch==2.14.1 with its deps: args.py imports torch; the CUDA build cannot import
#       without its nvidia-* libraries (`--no-deps` fails with "libcudnn.so.9: cannot
#       open shared object file"), and torch pulls triton, which flashlib needs too.
#   freetoken==0.2.1, flashlib==0.4.0: --no-deps (flashlib.kernels.slot_cache is
#       imported through freetoken.scheduler -> moe.offload_cache; it needs triton).
#   transformers 5.18, huggingface_hub, numpy, msgpack, pyzmq, tqdm: module-level
#       imports of freetoken.utils (hf.py, mp.py) and the gguf reader.
# Not needed: torchvision, apache-tvm-ffi, fastapi, uvicorn, modelscope, openai, ...
#
# Idempotent: a stamp file holds the requirement set; when it matches and the parser
# imports, nothing is installed. The last line printed is
# FREETOKEN_CONTRACT_PYTHON=<the venv's python>, which the test reads.
#
# Environment:
#   FREETOKEN_CONTRACT_VENV    where the venv lives (default /var/cache/freetoken-contract/venv
#                              as root, else ${XDG_CACHE_HOME:-~/.cache}/freetoken-contract/venv)
#   FREETOKEN_CONTRACT_BASE_PYTHON  interpreter to build it with (default python3.11: the
#                              torch wheel kept on this kind of machine is cp311)
set -euo pipefail

if [ -n "${FREETOKEN_CONTRACT_VENV:-}" ]; then
    venv="$FREETOKEN_CONTRACT_VENV"
elif [ "$(id -u)" = 0 ]; then
    venv=/var/cache/freetoken-contract/venv
else
    venv="${XDG_CACHE_HOME:-$HOME/.cache}/freetoken-contract/venv"
fi
base_python="${FREETOKEN_CONTRACT_BASE_PYTHON:-python3.11}"

# Exact pins where FreeToken pins (or the local torch file is), FreeToken 0.2.1's own
# ranges elsewhere. Changing this list rebuilds the venv.
torch_req=(torch==2.14.1)
nodeps_reqs=(freetoken==0.2.1 flashlib==0.4.0)
reqs=(
    "transformers>=5.18,<5.19"
    "huggingface_hub>=1.5,<2"
    "numpy>=2.0,<3"
    "msgpack>=1.1,<2"
    "pyzmq>=27,<28"
    "tqdm>=4.66,<5"
)
stamp_text="v1 ${torch_req[*]} | ${nodeps_reqs[*]} | ${reqs[*]}"
probe='from freetoken.server.args import parse_args; import freetoken.version as v; assert v.__version__ == "0.2.1", v.__version__'

mkdir -p "$(dirname "$venv")"
# One builder at a time (two pytest runs, or a test and a person).
exec 9>"$venv.lock"
flock 9

if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.contract-stamp" 2>/dev/null)" = "$stamp_text" ] \
        && "$venv/bin/python" -c "$probe" 2>/dev/null; then
    echo "--> contract venv $venv is up to date ($(du -sh "$venv" | cut -f1))"
    echo "FREETOKEN_CONTRACT_PYTHON=$venv/bin/python"
    exit 0
fi

command -v "$base_python" >/dev/null || {
    echo "error: $base_python not found; set FREETOKEN_CONTRACT_BASE_PYTHON" >&2
    exit 1
}

start=$SECONDS
step() { echo "--> [$((SECONDS - start))s] $*"; }

step "building contract venv at $venv with $base_python"
rm -rf "$venv"
"$base_python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
step "installing ${torch_req[*]} (CUDA build; imports without a GPU)"
"${pip[@]}" "${torch_req[@]}"
step "installing ${nodeps_reqs[*]} without dependencies"
"${pip[@]}" --no-deps "${nodeps_reqs[@]}"
step "installing the parser's import chain: ${reqs[*]}"
# pip warns that freetoken's other requirements are missing: on purpose.
if ! out=$("${pip[@]}" "${reqs[@]}" 2>&1); then
    echo "$out" >&2
    exit 1
fi
echo "$out" | grep -v -e "^ERROR: pip's dependency resolver" -e "^freetoken 0.2.1 requires" \
    -e "is ignored: it is neither a file nor a directory" || true
step "checking that the real parser imports"
"$venv/bin/python" -c "$probe"
echo "$stamp_text" >"$venv/.contract-stamp"
step "done in $((SECONDS - start))s, $(du -sh "$venv" | cut -f1) on disk"
echo "FREETOKEN_CONTRACT_PYTHON=$venv/bin/python"
