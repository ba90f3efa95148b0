"""What the validation report and the console call each model measured - what ran: its weights, read from its
folder (W4A8 when it holds a quantization description that labels some tensor W4A8 - its routed experts -, else W8A8
when it labels some tensor W8A8, else BF16), and the dtype the built-in runtime computed in when that is not the
weights' own."""

from __future__ import annotations

from pathlib import Path

from npuport.convert.ascend_writer import DESCRIPTION_NAME
from npuport.jsonfile import read_json_object

W8A8 = "W8A8"
W4A8 = "W4A8"
BF16 = "BF16"
NATIVE_DTYPE = "bfloat16"  # the dtype a BF16 source's weights and a W8A8 artifact's float tensors come in
ENDPOINT_MODEL = "the endpoint's model"  # a server's model with no local folder to read
REFERENCE_ENDPOINT_MODEL = "the reference endpoint's model"


def _labels_any(folder: Path, scheme: str) -> bool:
    """Whether `folder` holds a *quant_model_description.json (msModelSlim's format) labelling any tensor `scheme`."""
    for description in sorted(Path(folder).glob(f"*{DESCRIPTION_NAME}")):
        labels = read_json_object(description)
        if any(isinstance(label, str) and label.startswith(scheme) for label in labels.values()):
            return True
    return False


def is_w8a8(folder: Path) -> bool:
    """Whether `folder` holds a *quant_model_description.json (msModelSlim's format) labelling any tensor W8A8."""
    return _labels_any(folder, W8A8)


def weights_label(folder: Path) -> str:
    """"W4A8" (int4 experts: msModelSlim keeps model_quant_type W8A8_DYNAMIC for such a model, so the labels decide),
    "W8A8" or "BF16"."""
    if _labels_any(folder, W4A8):
        return W4A8
    return W8A8 if is_w8a8(folder) else BF16


def model_label(folder: Path | None, compute_dtype: str | None, *, reference: bool = False) -> str:
    """`folder`'s weights ("W4A8", "W8A8", "BF16"), with "(float32 compute)" when the built-in runtime computed in a
    dtype other than bfloat16 ("BF16 weights (float32 compute)"); `compute_dtype` None: a server computed, in a dtype
    not known here. Without a folder (a server's model only): "the endpoint's model" (or the reference's)."""
    if folder is None:
        return REFERENCE_ENDPOINT_MODEL if reference else ENDPOINT_MODEL
    weights = weights_label(folder)
    if compute_dtype is None or compute_dtype == NATIVE_DTYPE:
        return weights
    return f"{weights}{' weights' if weights == BF16 else ''} ({compute_dtype} compute)"


def report_labels(artifact: Path | None, reference: Path | None, *, dtype: str, artifact_served: bool,
                  reference_served: bool) -> tuple[str, str | None]:
    """The candidate's and the reference's labels (None: no reference), each from its folder and, on the built-in
    runtime, `dtype`; a served reference has no folder here. Two models that would read the same are told apart."""
    candidate = model_label(artifact, None if artifact_served else dtype)
    if reference_served:
        other = model_label(None, None, reference=True)
    elif reference is not None:
        other = model_label(reference, dtype)
    else:
        return candidate, None
    return candidate, other if other != candidate else f"{other} (reference)"
