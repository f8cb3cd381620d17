"""Batch mode: pairing, folder roots, a real batch with bad items, and a resumed rerun from the CLI."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ASSETS, REPO, add_piper_voice, assert_playable_mp4, run_ffmpeg, write_tight_face_photo

from heygem.errors import HeygemError
from heygem.jobs.batch import BatchItem, item_key, plan_items, resolve_under_roots, run_batch
from heygem.media.probing import probe


def touch(folder: Path, *names: str) -> list[Path]:
    paths = []
    for name in names:
        path = folder / name
        path.write_bytes(b"x")
        paths.append(path)
    return paths


def test_stem_pairing_pairs_by_name_and_explains_the_rest(tmp_path):
    files = touch(tmp_path, "anna.mp4", "anna.wav", "ben.jpg", "ben.mp3", "clip.mov", "photo.png", "voice.wav",
                  "twin.jpg", "twin.png", "twin.wav")
    items = {item.name: item for item in plan_items(files, "stem")}
    assert items["anna"].face_path.name == "anna.mp4" and items["anna"].audio_path.name == "anna.wav"
    assert items["ben"].problem is None and items["ben"].audio_path.name == "ben.mp3"
    assert items["clip"].problem is None and items["clip"].audio_path is None  # a video alone keeps its sound
    assert "photo with no audio" in items["photo"].problem
    assert "no face" in items["voice"].problem
    assert "several files are named twin" in items["twin"].problem


def test_cross_pairing_and_unique_names(tmp_path):
    files = touch(tmp_path, "a.jpg", "a.mp4", "x.wav", "y.m4a")
    items = plan_items(files, "cross")
    assert [item.name for item in items] == ["a__x", "a__y", "a__x-2", "a__y-2"]
    assert all(item.problem is None for item in items)
    with pytest.raises(HeygemError, match="at least one audio"):
        plan_items(touch(tmp_path, "only.jpg"), "cross")


def test_stem_pairing_gives_a_lone_face_every_audio_and_text(tmp_path):
    files = touch(tmp_path, "presenter.jpg", "intro.wav", "news.mp3", "outro.txt", "outro.wav")
    (tmp_path / "outro.txt").write_text("Goodbye.", encoding="utf-8")
    items = {item.name: item for item in plan_items(files, "stem")}
    assert sorted(items) == ["presenter__intro", "presenter__news", "presenter__outro"]
    assert all(item.problem is None and item.face_path.name == "presenter.jpg" for item in items.values())
    assert items["presenter__news"].audio_path.name == "news.mp3"
    assert items["presenter__outro"].audio_path.name == "outro.wav"  # the audio wins over the text, as by stem
    assert "outro.txt not spoken" in items["presenter__outro"].note
    # the face's own audio keeps its name beside the others
    (tmp_path / "own").mkdir()
    (tmp_path / "two").mkdir()
    both = {item.name for item in plan_items(touch(tmp_path / "own", "anna.jpg", "anna.wav", "extra.wav"), "stem")}
    assert both == {"anna", "anna__extra"}
    # with several faces an audio of no face's name says how to pair them all
    items = plan_items(touch(tmp_path / "two", "a.jpg", "b.jpg", "talk.wav"), "stem")
    orphan = next(item for item in items if item.name == "talk")
    assert "no face" in orphan.problem and "--pairing cross" in orphan.problem


def test_manifest_pairing_with_options_and_paths_kept_inside(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    files = touch(folder, "face one.jpg", "talk.mp4", "speech.wav")
    (tmp_path / "secret.wav").write_bytes(b"x")
    manifest = folder / "list.csv"
    manifest.write_text(
        "face,audio,name,options\n"
        'face one.jpg,speech.wav,first,"{""face.pads"": [0, 20, 0, 0]}"\n'
        "talk.mp4,,,\n"
        "face one.jpg,../secret.wav,escape,\n"
        "face one.jpg,speech.wav,badoptions,[1]\n", encoding="utf-8")
    items = {item.name: item for item in plan_items(files, str(manifest), base_dir=folder)}
    assert items["first"].options == {"face.pads": [0, 20, 0, 0]} and items["first"].problem is None
    assert items["talk"].audio_path is None and items["talk"].problem is None
    assert "outside the batch folder" in items["escape"].problem
    assert "JSON object" in items["badoptions"].problem
    uploaded = plan_items(files, str(manifest))  # uploads: entries are matched by file name
    assert "not among the uploaded files" in {item.name: item for item in uploaded}["escape"].problem


def test_server_folders_only_under_the_roots(tmp_path):
    root = tmp_path / "root"
    (root / "jobs" / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert resolve_under_roots("jobs/sub", [root]) == (root / "jobs" / "sub").resolve()
    assert resolve_under_roots(str(root / "jobs"), [root]) == (root / "jobs").resolve()
    for escaping in ("../outside", str(outside), "link", "jobs/../../outside", "/etc"):
        with pytest.raises(HeygemError, match="outside the folders"):
            resolve_under_roots(escaping, [root])
    with pytest.raises(HeygemError, match="switched off"):
        resolve_under_roots("jobs", [])


def test_item_key_changes_with_inputs_and_options(tmp_path):
    face, audio = touch(tmp_path, "f.jpg", "f.wav")
    item = BatchItem("f", face, audio)
    key = item_key(item, {"media.output_height": 256})
    assert key == item_key(item, {"media.output_height": 256})
    assert key != item_key(item, {"media.output_height": 360})
    audio.write_bytes(b"changed")
    assert key != item_key(item, {"media.output_height": 256})


@pytest.fixture(scope="module")
def batch_folder(tmp_path_factory) -> Path:
    """Three good pairs (one with a non-ASCII name, one a small photo the face fills), a corrupt face, a face-less
    picture, an audio without a face."""
    import cv2

    folder = tmp_path_factory.mktemp("batch input")
    speech = folder / "anna.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "1.2", str(speech))
    shutil.copyfile(ASSETS / "astronaut.jpg", folder / "anna.jpg")
    shutil.copyfile(ASSETS / "astronaut.jpg", folder / "bé 2.jpg")
    shutil.copyfile(speech, folder / "bé 2.wav")
    write_tight_face_photo(folder / "tight.png")
    shutil.copyfile(speech, folder / "tight.wav")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all" * 30)
    shutil.copyfile(speech, folder / "broken.wav")
    gradient = np.tile(np.linspace(30, 220, 256, dtype=np.uint8)[None, :, None], (256, 1, 3))
    cv2.imwrite(str(folder / "blank.png"), gradient)
    shutil.copyfile(speech, folder / "blank.wav")
    shutil.copyfile(speech, folder / "lonely.wav")
    (folder / "notes.txt").write_text("Words with no face to say them.", encoding="utf-8")
    return folder


def test_batch_makes_the_good_items_reports_the_bad_and_resumes(batch_folder, tmp_path):
    output, jobs_dir = tmp_path / "out", tmp_path / "jobs"
    results = {result.item.name: result for result in run_batch(
        batch_folder, output, "stem", {"media.output_height": 256}, jobs_dir=jobs_dir, show_progress=False)}
    assert {name: result.status for name, result in results.items()} == {
        "anna": "done", "bé 2": "done", "tight": "done", "blank": "failed", "broken": "failed", "lonely": "failed",
        "notes": "failed"}
    assert "notes.txt has no face" in results["notes"].error
    assert "broken.jpg" in results["broken"].error
    assert "face" in results["blank"].error.lower()
    assert "no face" in results["lonely"].error
    audio_seconds = probe(batch_folder / "anna.wav").duration
    for name in ("anna", "bé 2", "tight"):
        assert_playable_mp4(output / f"{name}.mp4", audio_seconds)
        assert json.loads((output / f"{name}.json").read_text(encoding="utf-8"))["seconds_per_stage"]
    with open(output / "summary.csv", newline="", encoding="utf-8") as handle:
        rows = {row["name"]: row for row in csv.DictReader(handle)}
    assert {name: row["status"] for name, row in rows.items()} == {
        "anna": "done", "bé 2": "done", "tight": "done", "blank": "failed", "broken": "failed", "lonely": "failed",
        "notes": "failed"}
    assert rows["anna"]["output"] == "anna.mp4" and rows["broken"]["error"]
    assert rows["anna"]["device"] == "auto" and rows["lonely"]["device"] == ""  # no --devices: the engine picks
    first_run = {name: (output / f"{name}.mp4").stat().st_mtime_ns for name in ("anna", "bé 2", "tight")}

    # The rerun goes through the command line: finished items are skipped, failed ones are tried again,
    # here on a worker placed by --devices.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    completed = subprocess.run(
        [sys.executable, "-m", "heygem", "batch", str(batch_folder), "--output", str(output), "--output-height", "256",
         "--jobs-dir", str(jobs_dir), "--quiet", "--devices", "cpu"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 1, completed.stderr  # some items failed
    assert "3 skipped" in completed.stdout and "4 failed" in completed.stdout, completed.stdout
    with open(output / "summary.csv", newline="", encoding="utf-8") as handle:
        rerun_rows = {row["name"]: row for row in csv.DictReader(handle)}
    rerun = {name: row["status"] for name, row in rerun_rows.items()}
    assert rerun_rows["blank"]["device"] == "cpu"  # it ran again, and failed, on the cpu worker
    assert rerun == {"anna": "skipped", "bé 2": "skipped", "tight": "skipped", "blank": "failed", "broken": "failed",
                     "lonely": "failed", "notes": "failed"}
    assert first_run == {name: (output / f"{name}.mp4").stat().st_mtime_ns for name in ("anna", "bé 2", "tight")}


def test_stem_pairing_speaks_text_files_and_audio_wins(tmp_path):
    files = touch(tmp_path, "carl.jpg", "dora.mp4", "dora.wav", "empty.jpg", "latin.jpg", "eve.txt")
    files += [tmp_path / name for name in ("carl.txt", "dora.txt", "empty.txt", "latin.txt")]
    (tmp_path / "carl.txt").write_text("Hello there. 你好。", encoding="utf-8")
    (tmp_path / "dora.txt").write_text("Not spoken.", encoding="utf-8")
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    (tmp_path / "latin.txt").write_bytes("café".encode("latin-1"))
    items = {item.name: item for item in plan_items(files, "stem")}
    assert items["carl"].problem is None and items["carl"].audio_path is None
    assert items["carl"].text == "Hello there. 你好。" and items["carl"].speech_label == "carl.txt (text)"
    assert items["dora"].audio_path.name == "dora.wav" and items["dora"].text is None
    assert items["dora"].note == "dora.txt not spoken: dora.wav gives the speech"
    assert "empty.txt is empty" in items["empty"].problem
    assert "latin.txt is not UTF-8" in items["latin"].problem
    assert "eve.txt has no face" in items["eve"].problem
    crossed = plan_items([tmp_path / "carl.jpg", tmp_path / "carl.txt"], "cross")
    assert [(item.name, item.text) for item in crossed] == [("carl__carl", "Hello there. 你好。")]
    key = item_key(items["carl"], {})
    items["carl"].text = "Something else."
    assert item_key(items["carl"], {}) != key


def test_manifest_text_column(tmp_path):
    files = touch(tmp_path, "face.jpg", "speech.wav")
    manifest = tmp_path / "list.csv"
    manifest.write_text("face,audio,text,name\n"
                        "face.jpg,,Good morning.,spoken\n"
                        "face.jpg,speech.wav,,recorded\n"
                        "face.jpg,speech.wav,Hello.,both\n"
                        "face.jpg,,   ,blank\n"
                        "face.jpg,,missing.txt,gone\n", encoding="utf-8")
    items = {item.name: item for item in plan_items(files, str(manifest), base_dir=tmp_path)}
    assert items["spoken"].text == "Good morning." and items["spoken"].problem is None
    assert items["spoken"].audio_path is None and items["spoken"].speech_label == "(text)"
    assert items["recorded"].text is None and items["recorded"].audio_path.name == "speech.wav"
    assert "line 4: give audio or text, not both" == items["both"].problem
    assert "line 5: the text is empty" in items["blank"].problem
    assert "missing.txt not found in the batch folder" == items["gone"].problem


def test_batch_speaks_text_items_with_subtitles(tmp_path):
    import av

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copyfile(ASSETS / "astronaut.jpg", folder / "carl.jpg")
    (folder / "carl.txt").write_text("Hello there. Nice to meet you.", encoding="utf-8")
    write_tight_face_photo(folder / "tight.png")  # a small photo the face fills
    (folder / "tight.txt").write_text("Hello.", encoding="utf-8")
    (folder / "list.csv").write_text("face,audio,text,name\n"
                                     "carl.jpg,,carl.txt,from-file\n"
                                     f"carl.jpg,,\"{'Far too long. ' * 3}\",too-long\n", encoding="utf-8")
    results = {result.item.name: result for result in run_batch(
        folder, tmp_path / "out", "stem",
        {"media.output_height": 160, "engine.name": "landmark", "text.max_characters": 40},
        jobs_dir=tmp_path / "jobs", show_progress=False)}
    assert results["carl"].status == "done", results["carl"].error
    assert results["tight"].status == "done", results["tight"].error
    with av.open(str(tmp_path / "out" / "carl.mp4")) as container:
        assert sorted(stream.type for stream in container.streams) == ["audio", "subtitle", "video"]
    cues = (tmp_path / "out" / "carl.srt").read_text(encoding="utf-8")
    assert "Hello there." in cues and "Nice to meet you." in cues
    with open(tmp_path / "out" / "summary.csv", newline="", encoding="utf-8") as handle:
        rows = {row["name"]: row for row in csv.DictReader(handle)}
    assert rows["carl"]["audio"] == "carl.txt (text)"

    manifest_results = {result.item.name: result for result in run_batch(
        folder, tmp_path / "out2", "list.csv",
        {"media.output_height": 160, "engine.name": "landmark", "text.max_characters": 40},
        jobs_dir=tmp_path / "jobs", show_progress=False)}
    assert manifest_results["too-long"].status == "failed"
    assert "at most 40 are spoken" in manifest_results["too-long"].error
    assert manifest_results["from-file"].status == "done"  # a .txt file's name in the cell: its words are spoken
    assert "Nice to meet you." in (tmp_path / "out2" / "from-file.srt").read_text(encoding="utf-8")


def test_text_items_speak_in_the_batch_s_voice_or_their_row_s(tmp_path, no_weights):
    """--voice for the batch, a manifest's voice column per row; each MP4's summary names its voice, and the
    cloned voice without consent is refused before anything runs."""
    add_piper_voice(no_weights, "en_US-test-medium", "en_US")
    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copyfile(ASSETS / "astronaut.jpg", folder / "carl.jpg")
    (folder / "list.csv").write_text("face,audio,text,name,voice\n"
                                     "carl.jpg,,Hello there.,batch-voice,\n"
                                     "carl.jpg,,Hello there.,row-voice,espeak-en\n"
                                     "carl.jpg,,Hello there.,cloned,clone\n", encoding="utf-8")
    options = {"media.output_height": 160, "engine.name": "landmark"}
    results = {result.item.name: result for result in run_batch(
        folder, tmp_path / "out", "list.csv", options, jobs_dir=tmp_path / "jobs", show_progress=False,
        voice="en_US-test-medium")}
    for name, voice in (("batch-voice", "en_US-test-medium"), ("row-voice", "espeak-en")):
        assert results[name].status == "done", results[name].error
        assert json.loads((tmp_path / "out" / f"{name}.json").read_text())["voice"] == voice
        assert probe(tmp_path / "out" / f"{name}.mp4").has_audio
    assert results["cloned"].status == "failed" and "consent" in results["cloned"].error
    item = BatchItem(name="a", face_path=folder / "carl.jpg", audio_path=None, text="Hello there.")
    assert item_key(item, options) != item_key(BatchItem(**{**item.__dict__, "voice": "espeak-en"}), options)


def test_batch_mode_does_not_import_the_command_line_module():
    """The command line builds the batch and jobs commands' parsers; batch mode does not import it back."""
    code = ("import argparse, sys, heygem.jobs.batch\n"
            "assert 'heygem.cli' not in sys.modules, 'heygem.jobs.batch imported heygem.cli'\n"
            "from heygem.cli import add_batch_parser, add_jobs_parser, option_overrides\n"
            "commands = argparse.ArgumentParser().add_subparsers()\n"
            "add_batch_parser(commands); add_jobs_parser(commands)\n"
            "args = commands.choices['batch'].parse_args(['in', '-o', 'out', '--fps', '12'])\n"
            "assert option_overrides(args) == {'media.fps': 12}, args\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_batch_zip_holds_what_the_command_line_writes(tmp_path):
    """Each finished item's .mp4 and .json, a text item's .srt, and summary.csv with every item, the ones that
    failed or never became a job included."""
    import zipfile

    from heygem.jobs.batch import BatchResult, submit_items, zip_results
    from heygem.jobs.files import RESULT_SUBTITLES_NAME
    from heygem.jobs.store import JobStore

    shutil.copyfile(ASSETS / "astronaut.jpg", tmp_path / "anna.jpg")
    shutil.copyfile(ASSETS / "speech_en.wav", tmp_path / "anna.wav")
    items = [BatchItem("anna", tmp_path / "anna.jpg", tmp_path / "anna.wav"),
             BatchItem("told", tmp_path / "anna.jpg", None, text="Hello there."),
             BatchItem("broken", tmp_path / "anna.jpg", tmp_path / "anna.wav"),
             BatchItem("lonely", None, tmp_path / "anna.wav", problem="anna.wav has no face named lonely.*")]
    store = JobStore(tmp_path / "jobs")
    outcome = submit_items(store, items, {"media.output_height": 160}, "batch-1")
    assert zip_results(store, "batch-1") is None  # nothing done yet
    for _ in range(3):
        job = store.claim_next("test:1", batch="batch-1")
        if job.label == "broken":
            store.finish(job.id, "test:1", "failed", error="the face was lost")
            continue
        job.result_path.write_bytes(b"video of " + job.label.encode())
        job.summary_path.write_text('{"seconds_per_stage": {}}', encoding="utf-8")
        if job.label == "told":
            (job.directory / RESULT_SUBTITLES_NAME).write_text("1\n00:00:00,000 --> 00:00:01,000\nHello there.\n",
                                                               encoding="utf-8")
        store.finish(job.id, "test:1", "done", engine="landmark")
    archive_path = zip_results(store, "batch-1", [BatchResult(items[3], "failed", error=str(outcome["lonely"]))])
    with zipfile.ZipFile(archive_path) as archive:
        assert sorted(archive.namelist()) == ["anna.json", "anna.mp4", "summary.csv", "told.json", "told.mp4",
                                              "told.srt"]
        assert archive.read("told.mp4") == b"video of told" and b"Hello there." in archive.read("told.srt")
        rows = {row["name"]: row for row in csv.DictReader(archive.read("summary.csv").decode().splitlines())}
    assert rows["anna"]["status"] == "done" and rows["anna"]["output"] == "anna.mp4"
    assert rows["anna"]["audio"] == "anna.wav" and rows["anna"]["face"] == "anna.jpg"
    assert rows["told"]["audio"] == "(text)" and rows["told"]["engine"] == "landmark"
    assert rows["broken"]["status"] == "failed" and rows["broken"]["error"] == "the face was lost"
    assert rows["lonely"]["status"] == "failed" and "no face named lonely" in rows["lonely"]["error"]
    assert not list((tmp_path / "jobs" / "batches").glob(".*"))  # no partial files left behind
    store.close()


def test_the_batch_preview_says_which_items_will_fail_before_start(tmp_path):
    from heygem.ui.batch import preview_table

    run_ffmpeg("-f", "lavfi", "-i", "color=c=gray:s=64x64:d=1", "-c:v", "libx264", "-pix_fmt", "yuv420p",
               str(tmp_path / "mute.mp4"))
    shutil.copyfile(ASSETS / "astronaut.jpg", tmp_path / "anna.jpg")
    shutil.copyfile(ASSETS / "speech_en.wav", tmp_path / "anna.wav")
    (tmp_path / "ben.jpg").write_bytes(b"not a picture")
    shutil.copyfile(ASSETS / "speech_en.wav", tmp_path / "ben.wav")
    items = plan_items(sorted(tmp_path.iterdir()), "stem")
    table, summary = preview_table(items)
    rows = {row["item"]: row for row in table.to_dict("records")}
    assert rows["anna"]["status"] == "not started" and rows["anna"]["stage / error"] == ""
    assert rows["mute"]["status"] == "will fail" and "has no sound of its own" in rows["mute"]["stage / error"]
    assert rows["ben"]["status"] == "will fail" and "ben.jpg" in rows["ben"]["stage / error"]
    assert "1 of 3 item(s) will run" in summary and "2 will fail" in summary
