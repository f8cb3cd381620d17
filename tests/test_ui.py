"""The web form's options and the System tab's weights table follow what the weights folder holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from heygem.config import Config, apply_overrides
from heygem.ui.common import (
    detector_choices,
    engine_choices,
    installed_weights,
    job_card,
    options_from_controls,
    restorer_choices,
)
from heygem.ui.system import weights_frame


@pytest.fixture()
def weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(tmp_path))
    return tmp_path


def values(choices):
    return [value for _, value in choices]


def test_the_form_offers_only_what_is_installed(weights):
    installed = installed_weights()
    assert installed == set()
    assert values(engine_choices(installed)) == ["auto", "landmark"]
    assert values(restorer_choices(installed)) == ["auto", "sharpen", "none"]
    assert values(detector_choices(installed)) == ["mediapipe"]
    for name in ("wav2lip_gan.pth", "GFPGANv1.4.pth", "s3fd-619a316812.pth"):
        (weights / name).write_bytes(b"x")
    installed = installed_weights()
    assert installed == {"wav2lip_gan", "gfpgan_v1.4", "s3fd"}
    assert values(engine_choices(installed)) == ["auto", "wav2lip", "landmark"]
    assert values(restorer_choices(installed)) == ["auto", "gfpgan", "sharpen", "none"]
    assert values(detector_choices(installed)) == ["mediapipe", "s3fd"]


def test_form_values_become_valid_options(weights):
    options = options_from_controls("auto", 0, 10, 0, 0, 5, "none", 0, 25, "s3fd")
    assert options["restore.enabled"] is False and options["restore.method"] == "none"
    config = apply_overrides(Config(), options)
    assert config.restore.method == "none" and config.face.pads == [0, 10, 0, 0] and config.face.detector == "s3fd"
    sharpen = apply_overrides(Config(), options_from_controls("landmark", 0, 0, 0, 0, 1, "sharpen", 360, 25))
    assert sharpen.restore.enabled and sharpen.restore.method == "sharpen" and sharpen.media.output_height == 360


def test_the_system_tab_lists_the_weights_as_the_command_does(weights):
    (weights / "GFPGANv1.4.pth").write_bytes(b"not the released file")
    frame = weights_frame()
    rows = {row["name"]: row for row in frame.to_dict("records")}
    assert {"wav2lip", "wav2lip_gan", "gfpgan_v1.4", "s3fd", "musetalk_v15_unet", "musetalk_vae"} <= set(rows)
    assert rows["gfpgan_v1.4"]["state"] == "wrong checksum" and rows["gfpgan_v1.4"]["file"].endswith("GFPGANv1.4.pth")
    assert rows["wav2lip"]["state"] == "missing" and rows["s3fd"]["for"] == "detector"
    assert "--restorer gfpgan" in rows["gfpgan_v1.4"]["enables"]


def test_the_job_card_says_which_restorer_ran():
    job = SimpleNamespace(status="done", seconds=12.5, engine="wav2lip", progress=1.0, error=None, label=None,
                          id="20261130-1", read_summary=lambda: {"restorer": "gfpgan"})
    card = job_card(job)
    assert "with the wav2lip engine" in card and "restorer: gfpgan" in card
    job.read_summary = lambda: None  # a summary that could not be read: no restorer shown, no error
    assert "restorer" not in job_card(job)
