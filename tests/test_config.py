"""Options: defaults file, overrides, validation, and the CLI flags built from them."""

import dataclasses

import pytest
import yaml

from heygem.cli import build_parser, option_overrides
from heygem.config import DEFAULT_CONFIG_PATH, Config, apply_overrides, iter_options, load_config
from heygem.errors import HeygemError


def test_default_yaml_holds_every_default_with_a_comment():
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    defaults = Config()
    lines = DEFAULT_CONFIG_PATH.read_text().splitlines()
    for section, leaf in iter_options():
        assert data[section][leaf.name] == getattr(getattr(defaults, section), leaf.name), (section, leaf.name)
        line = next(text for text in lines if text.strip().startswith(f"{leaf.name}:"))
        assert f"# {leaf.metadata['flag']}:" in line
        # the comment is the option's help, word for word: one text for --help, the YAML and the page
        assert line.endswith(f"# {leaf.metadata['flag']}: {leaf.metadata['help']}"), (section, leaf.name)
    assert load_config() == defaults


def test_overrides_nested_and_dotted_and_unknown_keys_fail():
    config = apply_overrides(Config(), {"face.pads": "0 20 0 0", "media": {"fps": "30"}, "restore.enabled": "no"})
    assert config.face.pads == [0, 20, 0, 0] and config.media.fps == 30.0 and config.restore.enabled is False
    with pytest.raises(HeygemError, match="unknown option face.padding"):
        apply_overrides(Config(), {"face.padding": 3})
    with pytest.raises(HeygemError, match="unknown option section"):
        apply_overrides(Config(), {"colour": {"x": 1}})
    with pytest.raises(HeygemError, match="--engine must be one of"):
        apply_overrides(Config(), {"engine.name": "sadtalker"})
    with pytest.raises(HeygemError, match="--pads takes four numbers"):
        apply_overrides(Config(), {"face.pads": [1, 2]})


def test_yaml_file_with_unknown_key_is_refused(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("face:\n  smooth_window: 9\n  wibble: 1\n")
    with pytest.raises(HeygemError, match="wibble"):
        load_config(path)
    path.write_text("face:\n  smooth_window: 9\n")
    assert load_config(path).face.smooth_window == 9


def test_cli_flags_cover_every_option_and_override_the_config():
    parser = build_parser()
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    for _, leaf in iter_options():
        assert leaf.metadata["flag"] in help_text
    args = parser.parse_args(["generate", "--face", "f.jpg", "--audio", "a.wav", "--output", "o.mp4",
                              "--pads", "0", "15", "0", "0", "--no-restore", "--fps", "30"])
    overrides = option_overrides(args)
    assert overrides == {"face.pads": [0, 15, 0, 0], "restore.enabled": False, "media.fps": 30.0}
    config = load_config(None, overrides)
    assert config.face.pads == [0, 15, 0, 0] and not config.restore.enabled
    assert config.face.smooth_window == Config().face.smooth_window  # untouched options keep the file's value
    assert dataclasses.asdict(config)["media"]["fps"] == 30.0


def test_remote_clients_name_checkpoints_inside_the_weights_folder_only(tmp_path):
    from heygem.jobs.request import limit_remote_options

    (tmp_path / "wav2lip_gan.pth").write_bytes(b"x")
    limited = limit_remote_options({"engine.checkpoint": "wav2lip_gan.pth", "face.pads": [0, 1, 0, 0]}, tmp_path)
    assert limited == {"engine.checkpoint": str(tmp_path / "wav2lip_gan.pth"), "face.pads": [0, 1, 0, 0]}
    assert limit_remote_options({"engine.checkpoint": None}, tmp_path) == {"engine.checkpoint": None}
    for value in ("/etc/passwd", "../wav2lip_gan.pth", "..", "a\\\\b.pth", 3):
        with pytest.raises(HeygemError, match="not a path"):
            limit_remote_options({"engine.checkpoint": value}, tmp_path)
    with pytest.raises(HeygemError, match="no file named 'other.pth'"):
        limit_remote_options({"engine.checkpoint": "other.pth"}, tmp_path)
