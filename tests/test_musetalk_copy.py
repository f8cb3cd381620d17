"""The MuseTalk network copy kept beside the official files (heygem.engines.musetalk.network_copy): written after
the first strict load, used by the next start with the same frames, dropped when an official file changes or the
copy is damaged, and never needed (one log line) where the folder cannot be written. On reduced random-init files."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch
from conftest import REPO

from heygem.config import EngineConfig
from heygem.engines.musetalk.files import find_musetalk_files
from heygem.engines.musetalk.network_copy import FOLDER_NAME
from heygem.engines.musetalk.random_files import write_random_files
from heygem.errors import HeygemError


def new_engine(folder):
    from heygem.engines.musetalk.engine import MuseTalkEngine

    return MuseTalkEngine(find_musetalk_files(folder), EngineConfig(device="cpu", musetalk_parsing="landmarks"),
                          use_cache=False)


def faces_of(engine, seed: int = 0) -> torch.Tensor:
    """(1, 3, 256, 256) a face from fixed latents and audio features: what the copy must not change."""
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 8, 32, 32, generator=generator)
    audio = torch.randn(1, 50, 384, generator=generator)
    return engine.generate_faces(latents, audio)


def copies(folder) -> list:
    return sorted((folder / FOLDER_NAME).glob("*.safetensors")) if (folder / FOLDER_NAME).is_dir() else []


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_random_files(tmp_path_factory.mktemp("weights") / "musetalk", size="reduced", seed=0)


@pytest.fixture
def folder(pristine, tmp_path):
    """The random files, without a copy, in a folder of the test's own."""
    return Path(shutil.copytree(pristine, tmp_path / "musetalk", ignore=shutil.ignore_patterns(FOLDER_NAME)))


def test_the_copy_is_written_after_the_first_load_and_gives_the_same_frames_on_the_next(folder):
    first = new_engine(folder)
    assert first.weights_source == "official files" and "write copy" in first.load_seconds
    assert len(copies(folder)) == 1
    second = new_engine(folder)
    assert second.weights_source == "network copy" and "read unet" not in second.load_seconds
    assert torch.equal(faces_of(first), faces_of(second))  # bit for bit: the step's own tensors
    state, again = first.step.network_state(), second.step.network_state()
    assert state.keys() == again.keys() and all(torch.equal(state[key], again[key]) for key in state)


def test_a_changed_official_file_is_loaded_strictly_and_replaces_the_copy(folder):
    before = faces_of(new_engine(folder))
    old_copy = copies(folder)
    unet_path = folder / "musetalkV15" / "unet.pth"
    state = torch.load(unet_path, weights_only=True)
    state["conv_out.weight"] = state["conv_out.weight"] * 1.5  # another file of the same size and layout
    torch.save(state, unet_path)
    changed = new_engine(folder)
    assert changed.weights_source == "official files"
    assert not torch.equal(faces_of(changed), before)
    assert len(copies(folder)) == 1 and copies(folder) != old_copy  # the stale copy is gone
    assert new_engine(folder).weights_source == "network copy"
    # a wrong official file is still refused, copy or not
    shutil.copyfile(folder / "sd-vae" / "diffusion_pytorch_model.bin", unet_path)
    with pytest.raises(HeygemError, match="unet.pth does not fit the MuseTalk UNet"):
        new_engine(folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_copy_falls_back_to_the_official_files_with_one_line(folder, caplog, damage):
    expected = faces_of(new_engine(folder))
    (path,) = copies(folder)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * 64 + data[64:])
    with caplog.at_level(logging.INFO, logger="heygem"):
        engine = new_engine(folder)
    lines = [record.getMessage() for record in caplog.records if "network copy" in record.getMessage()]
    assert engine.weights_source == "official files" and len(lines) == 1 and "cannot use" in lines[0]
    assert torch.equal(faces_of(engine), expected)
    assert new_engine(folder).weights_source == "network copy"  # written again


def test_a_folder_that_cannot_be_written_still_loads_with_one_line(folder, caplog):
    (folder / FOLDER_NAME).write_text("in the way")  # nothing can be made under it (as a read-only folder)
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
    try:
        with caplog.at_level(logging.INFO, logger="heygem"):
            first, second = new_engine(folder), new_engine(folder)
    finally:
        os.chmod(folder, 0o755)
    lines = [record.getMessage() for record in caplog.records if "no network copy" in record.getMessage()]
    assert first.weights_source == second.weights_source == "official files" and len(lines) == 2
    assert torch.equal(faces_of(first), faces_of(second))
    assert not [path for path in folder.rglob("*") if path.name.endswith(".tmp")]


def test_the_libraries_import_without_their_unused_optional_packages():
    """peft and scikit-learn stay out of the process while the engine's modules import (when installed, they
    cost seconds), and import as usual afterwards."""
    code = ("import sys, importlib.util; from heygem.engines.musetalk.loading import import_libraries; "
            "import_libraries(); print(sorted(m for m in ('peft', 'sklearn') if m in sys.modules)); "
            "print([importlib.util.find_spec(m) is not None for m in ('peft', 'sklearn')])")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr
    imported, findable = result.stdout.strip().splitlines()[-2:]
    assert imported == "[]"
    assert "None" not in findable
