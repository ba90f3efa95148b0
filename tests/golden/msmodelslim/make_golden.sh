#!/usr/bin/env bash
# Re-creates the msModelSlim golden artifacts of this folder from scratch (README.md says what they are):
# builds the two small inputs with `npuport make-tiny`, runs msModelSlim 26.1.0 on a CPU with each of its
# lab_practice/qwen3_5_moe recipes, and copies what it wrote (tokenizer and processor files aside) into
# <OUT>/<case>/, with golden.json (inputs, fingerprints, recipe checksums, versions) beside them.
#
# usage: make_golden.sh MSMODELSLIM_VENV WORK_DIR [OUT]
#   MSMODELSLIM_VENV  a venv for msModelSlim alone (never the project's): created with the pinned packages below
#                     when the folder does not exist. MSMODELSLIM_WHEEL=FILE installs msModelSlim from a downloaded
#                     wheel instead of the package index.
#   WORK_DIR          scratch folder, created (must not exist): inputs, msModelSlim's raw outputs, its logs
#   OUT               where the golden case folders and golden.json go (default: this script's folder); an
#                     existing case folder there is replaced
# environment: NPUPORT  the npuport command (default: npuport); PYTHON  the interpreter of a new venv
# (default: python3.11)
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=$1
WORK=$2
OUT=${3:-$HERE}
NPUPORT=${NPUPORT:-npuport}
PYTHON=${PYTHON:-python3.11}

# What worked on a CPU-only machine: a CUDA build of torch (it runs on a CPU) with the torchvision built against
# it, because msModelSlim's Qwen3.5 adapter builds a Qwen3-VL processor, which loads torchvision; and
# msModelSlim's own transformers pin for its qwen3_5_moe adapter (its config.ini: transformers==5.2.0).
PINS=(torch==2.14.1 torchvision==0.29.1 pillow==13.0.0 transformers==5.2.0 safetensors==0.8.0 pyyaml)

# The recipes these goldens were made with (sha256 of each file in msmodelslim/lab_practice/qwen3_5_moe/).
declare -A RECIPE_SHA256=(
    [qwen3_5_dense_w8a8]=10d082affc890a2d8e98ad15bea1e96a4bd70d5ccd457b696189b89ba0953da6
    [qwen3_6_27B_w8a8]=409c08ccbdac1482672365b17606c8fe9b0c178b10f92fd303abfb19ed54e848
    [qwen3_6_dense_w8a8]=98b092ec05d3410637324cfa38872e4982f354d0eaa328b6a8ac8b94cf21cfc3
    [qwen3_5_moe_w8a8]=6e9e21ba1b859e0e187636cddc0cb64c0d3127fbad341748acfb8f14b130af1a
    [qwen3_5_235B_w8a8]=c17787cb28dff587c960fa89d80e29421b53f35f6305597f6f8a69cfb8f9f33f
    [qwen3.5_moe_w4a8]=e004d2b1e81694f47995ab615194acb22db7488eab8c5d45bbf4e37678954f3f
)
# case  input  --model_type (msModelSlim's adapter, and the name of the recipe record it writes)  npuport recipe
CASES=(
    "qwen3_5_dense_w8a8  dense Qwen3.5-27B       qwen3_5_dense_w8a8.yaml"
    "qwen3_6_27B_w8a8    dense Qwen3.6-27B       qwen3_6_27b_w8a8.yaml"
    "qwen3_6_dense_w8a8  dense Qwen3.6-27B       qwen3_6_dense_w8a8.yaml"
    "qwen3_5_moe_w8a8    moe   Qwen3.5-35B-A3B   qwen3_5_moe_w8a8.yaml"
    "qwen3_5_235B_w8a8   moe   Qwen3.5-397B-A17B qwen3_5_235b_w8a8.yaml"
    "qwen3.5_moe_w4a8    moe   Qwen3.5-397B-A17B qwen3_5_moe_w4a8.yaml"
)

if [[ -e $WORK ]]; then
    echo "$WORK exists; give a new folder" >&2
    exit 2
fi
mkdir -p "$WORK"/in "$WORK"/msin "$WORK"/out "$WORK"/log "$OUT"
WORK=$(cd "$WORK" && pwd)

if [[ ! -d $VENV ]]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV"/bin/pip install "${PINS[@]}" "${MSMODELSLIM_WHEEL:-msmodelslim==26.1.0}"
fi
PY=$VENV/bin/python
"$PY" - <<'PYEOF'
import importlib.metadata as md
got = md.version("msmodelslim")
if got != "26.1.0":
    raise SystemExit(f"msmodelslim {got} is installed; these goldens are made with 26.1.0")
PYEOF
LAB=$("$PY" -c 'import msmodelslim, pathlib; print(pathlib.Path(msmodelslim.__file__).parent / "lab_practice" / "qwen3_5_moe")')

for line in "${CASES[@]}"; do
    read -r case_name _ <<<"$line"
    got=$(sha256sum "$LAB/$case_name.yaml" | cut -d' ' -f1)
    if [[ $got != "${RECIPE_SHA256[$case_name]}" ]]; then
        echo "$LAB/$case_name.yaml: sha256 $got, not the recipe these goldens were made with" >&2
        exit 1
    fi
done

# The inputs. msModelSlim's Qwen3.5 path always prepares its calibration images (even for W8A8_DYNAMIC, which
# never runs the model), through the tokenizer's chat template with a message whose content is a list of parts;
# make-tiny's template takes string content only. So msModelSlim reads a copy of each input whose
# chat_template.jinja also takes content parts (ours, below). The tensors are make-tiny's, byte for byte.
for arch in dense moe; do
    "$NPUPORT" make-tiny "$WORK/in/$arch" --arch "$arch" --layout multimodal --size tiny --quiet
    cp -r "$WORK/in/$arch" "$WORK/msin/$arch"
    cat >"$WORK/msin/$arch/chat_template.jinja" <<'JINJA'
{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\n' }}{%- if message['content'] is string %}{{- message['content'] }}{%- else %}{%- for part in message['content'] %}{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
JINJA
done

for line in "${CASES[@]}"; do
    read -r case_name arch model_type _ <<<"$line"
    echo "== $case_name: msmodelslim quant --model_type $model_type (input: $arch)"
    (cd "$WORK" && "$VENV"/bin/msmodelslim quant --model_type "$model_type" --model_path "msin/$arch" \
        --save_path "out/$case_name" --device cpu --config_path "$LAB/$case_name.yaml") >"$WORK/log/$case_name.txt" 2>&1 || {
        echo "msModelSlim failed on $case_name; the end of $WORK/log/$case_name.txt:" >&2
        tail -n 30 "$WORK/log/$case_name.txt" >&2
        exit 1
    }
    rm -rf "${OUT:?}/$case_name"
    mkdir -p "$OUT/$case_name"
    for f in "$WORK/out/$case_name"/*; do
        name=$(basename "$f")
        case $name in
            *.safetensors | quant_model_weights.safetensors.index.json | quant_model_description.json | config.json | *_best_practice.yaml)
                cp "$f" "$OUT/$case_name/$name"
                chmod 644 "$OUT/$case_name/$name" ;;
        esac
    done
done

# golden.json: what the test needs to rebuild each input and to know each case, and the versions that made them.
CASE_LINES=$(printf '%s\n' "${CASES[@]}")
export CASE_LINES WORK OUT LAB
"$PY" - "$HERE/fingerprint.py" <<'PYEOF'
import hashlib, importlib.metadata as md, importlib.util, json, os, platform, sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("fingerprint", sys.argv[1])
fingerprint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fingerprint)
work, out, lab = Path(os.environ["WORK"]), Path(os.environ["OUT"]), Path(os.environ["LAB"])
inputs = {
    arch: {
        "make_tiny": f"npuport make-tiny IN/{arch} --arch {arch} --layout multimodal --size tiny",
        "spec": {"arch": arch, "layout": "multimodal", "size": "tiny"},
        "tensor_sha256": fingerprint.tensor_fingerprint(work / "in" / arch),
    }
    for arch in ("dense", "moe")
}
cases = {}
for line in os.environ["CASE_LINES"].splitlines():
    case, arch, model_type, ours = line.split()
    recipe = lab / f"{case}.yaml"
    written = sorted(p.name for p in (work / "out" / case).iterdir())
    cases[case] = {
        "input": arch,
        "model_type": model_type,
        "lab_practice_recipe": recipe.name,
        "lab_practice_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest(),
        "npuport_recipe": ours,
        "int4_experts": "w4a8" in case,
        "files_written": written,
        "files_kept": sorted(p.name for p in (out / case).iterdir()),
    }
packages = ("msmodelslim", "torch", "torchvision", "transformers", "safetensors", "pillow", "accelerate", "wcmatch",
            "numpy", "huggingface_hub", "tokenizers", "pyyaml")
doc = {
    "made_by": "msModelSlim 26.1.0 (Mulan PSL v2), on a CPU, by make_golden.sh",
    "environment": {"python": platform.python_version(), **{p: md.version(p) for p in packages}},
    "inputs": inputs,
    "cases": cases,
}
(out / "golden.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
print(json.dumps({"inputs": {k: v["tensor_sha256"] for k, v in inputs.items()}, "environment": doc["environment"]},
                 indent=2))
PYEOF
echo "wrote $(du -sh "$OUT" | cut -f1) to $OUT"
