"""The web form's options and the System tab's weights table follow what the weights folder holds."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from heygem.config import Config, apply_overrides
from heygem.errors import HeygemError
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


def test_downloads_are_named_after_their_inputs():
    from heygem.jobs.files import download_name

    def job(face, audio, label=None):
        return SimpleNamespace(face_name=face, audio_name=audio, label=label)

    assert download_name(job("astronaut.jpg", "speech_en.wav")) == "astronaut-speech_en.mp4"
    # the video's own sound: not the uploaded file's own name, which a download would collide with
    assert download_name(job("anna talking.mp4", None)) == "anna talking-own-audio.mp4"
    assert download_name(job("astronaut.jpg", "speech.wav")) == "astronaut-text.mp4"  # typed text
    assert download_name(job("astronaut.jpg", "audio-speech.wav")) == "astronaut-audio-speech.mp4"  # an upload
    assert download_name(job("a.jpg", "b.wav", label="item-3")) == "item-3.mp4"  # a batch item keeps its name


def test_the_page_shows_each_user_their_jobs_and_serves_copies_not_the_job_folders(tmp_path, monkeypatch):
    import shutil

    from conftest import ASSETS

    from heygem.jobs.store import DONE, JobStore, process_owner
    from heygem.jobs.users import Users
    from heygem.ui.access import PageAccess

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    store = JobStore(tmp_path / "outputs")
    users = Users.parse("admin alice:a-secret\nbob:b-secret\ncarol:c-secret\n")
    access = PageAccess(store, users)
    as_user = {name: SimpleNamespace(username=name) for name in ("alice", "bob", "carol")}
    speech = ASSETS / "speech_en.wav"
    bobs = store.create_job(ASSETS / "astronaut.jpg", speech, submitter=access.submitter(as_user["bob"]))
    carols = store.create_job(ASSETS / "astronaut.jpg", speech, submitter="carol")
    owner = process_owner("test")
    claimed = store.claim_next(owner)
    shutil.copyfile(speech, claimed.result_path)
    store.finish(claimed.id, owner, DONE)

    assert [job.id for job in access.jobs(as_user["bob"])] == [bobs]
    assert {job.id for job in access.jobs(as_user["alice"])} == {bobs, carols}
    assert access.counts(as_user["carol"])["queued"] == 1 and access.counts(as_user["carol"])["done"] == 0
    assert access.find(bobs, as_user["carol"]) is None and access.find(bobs, as_user["alice"]).id == bobs
    assert access.find(bobs, SimpleNamespace(username=None)) is None  # no known user: no job
    with pytest.raises(HeygemError, match="sign in first"):
        access.submitter(SimpleNamespace(username="mallory"))
    check = access.page_auth(None)  # async: Gradio's login awaits it, and it checks in a worker thread
    assert asyncio.run(check("bob", "b-secret")) and not asyncio.run(check("bob", "c-secret"))

    copy = Path(access.deliver(store.get(bobs)))
    assert copy.name == "astronaut-speech_en.mp4" and copy.read_bytes() == speech.read_bytes()
    assert copy.is_relative_to(tmp_path / "gradio") and not copy.is_relative_to(store.outputs_dir)
    assert access.deliver(store.get(bobs)) == str(copy)  # one copy per job and file
    paths = access.served_paths()
    assert paths["allowed_paths"] == [] and str(store.outputs_dir) in paths["blocked_paths"]
    access.forget(bobs)
    assert not copy.exists()
    copy = Path(access.deliver(store.get(bobs)))
    store.delete(bobs)  # through REST or `python -m heygem jobs delete`, not this page
    access.forget_deleted(every_seconds=0)  # as the next job list or delivery does, at most every 30 s
    assert not copy.exists() and not copy.parent.exists()
    assert access.deliver(store.get(carols)) is None  # no video yet
    alone = PageAccess(store)  # no --users: one person, who sees every job
    assert {job.id for job in alone.jobs(SimpleNamespace(username=None))} == {carols}
    store.close()


def test_the_stages_are_drawn_on_one_time_line_in_plain_words_not_added_up():
    import re

    from heygem.ui.timeline import stage_bars, timeline_html

    summary = {"total_seconds": 6.1,  # stages that ran at the same time: 9.4 s of busy time in a 6.1 s job
               "seconds_per_stage": {"encode": 2.0, "faces": 3.0, "probe": 0.1, "generate": 4.0, "load_engine": 0.3},
               "stage_spans": {"encode": [1.5, 6.0], "faces": [0.4, 5.2], "probe": [0.0, 0.1], "generate": [1.0, 5.9],
                               "load_engine": [0.2, 0.5]}}
    bars = stage_bars(summary)
    assert [bar.name for bar in bars] == ["reading the inputs", "loading the model", "finding faces",
                                          "drawing mouths", "encoding"]  # in the order they started
    assert [(bar.start, bar.end) for bar in bars][2] == (0.4, 5.2)
    drawn = timeline_html(summary)
    assert "6.1 s in all" in drawn and "faces" in drawn
    positions = [(float(left), float(width)) for left, width in
                 re.findall(r'class="stage-bar" style="left:([\d.]+)%;width:([\d.]+)%"', drawn)]
    assert len(positions) == 5 and all(left + width <= 100.01 for left, width in positions)
    assert positions[2] == pytest.approx((100 * 0.4 / 6.1, 100 * 4.8 / 6.1), abs=0.01)  # faces: 0.4 s to 5.2 s
    older = timeline_html({"total_seconds": 2.0, "seconds_per_stage": {"faces": 1.0}})  # no spans kept yet
    assert "was not recorded" in older and 'left:0.00%;width:50.00%' in older
    assert timeline_html({}) == "" and timeline_html(None) == ""


def test_the_jobs_table_shows_a_text_jobs_words_a_small_face_and_clipped_errors(tmp_path):
    import base64
    import json

    from heygem.jobs.files import SPEECH_NAME, TEXT_NAME
    from heygem.media.probing import probe
    from heygem.media.thumbnail import thumbnail_jpeg
    from heygem.ui.jobs import JobPictures, clipped, speech_cell

    words = "Good evening. I was typed into a web page and spoken by a voice that reads long sentences."
    (tmp_path / TEXT_NAME).write_text(json.dumps({"text": words}), encoding="utf-8")
    (tmp_path / "face.jpg").write_bytes((Path(__file__).parents[1] / "assets" / "astronaut.jpg").read_bytes())
    text_job = SimpleNamespace(id="a", directory=tmp_path, face_name="face.jpg", face_path=tmp_path / "face.jpg",
                               audio_name=SPEECH_NAME)
    pictures = JobPictures()
    cell = speech_cell(text_job, pictures.words(text_job))
    assert "speech.wav" not in cell and "“Good evening. I was typed" in cell and "…" in cell
    assert f'title="“{words}"' in cell  # the whole words on hover
    audio_job = SimpleNamespace(id="b", directory=tmp_path, face_name="face.jpg", face_path=tmp_path / "face.jpg",
                                audio_name="hello.wav")
    assert speech_cell(audio_job, pictures.words(audio_job)) == "hello.wav"
    error = "the face detector found no face in any frame: " * 5
    shown = clipped(error, 90)
    assert f'title="{error}"' in shown and len(shown) < len(error) + 140
    budget = [1]
    url = pictures.thumbnail(text_job, budget)
    assert url.startswith("data:image/jpeg;base64,") and budget == [0]
    assert pictures.thumbnail(audio_job, budget) is None  # none made past the budget: the next refresh makes it
    thumbnail = tmp_path / "thumbnail.jpg"
    thumbnail.write_bytes(base64.b64decode(url.split(",", 1)[1]))
    assert probe(thumbnail).height == 48
    assert thumbnail_jpeg(tmp_path / "missing.mp4") is None


def test_a_batch_zip_handed_to_the_page_outlives_the_sweep_of_deleted_jobs(tmp_path, monkeypatch):
    from heygem.jobs.store import JobStore
    from heygem.ui.access import PageAccess

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    store = JobStore(tmp_path / "outputs")
    access = PageAccess(store)
    archive = tmp_path / "outputs" / "batch-1.zip"
    archive.write_bytes(b"PK\x05\x06" + bytes(18))
    served = Path(access.deliver_file(archive, archive.name))
    access.forget_deleted(every_seconds=0)  # copies of jobs deleted elsewhere go; a batch's zip is no job's copy
    assert served.is_file()
    store.close()


def test_the_card_of_a_finished_job_says_its_warnings_in_the_browsers_language():
    from heygem.ui.common import language

    summary = {"restorer": "none",
               "warnings": ["2 faces found; animated face 1 (the largest)", "the <speech> is silent"]}
    job = SimpleNamespace(status="done", seconds=3.0, engine="landmark", progress=1.0, error=None, label=None,
                          id="20261206-1", read_summary=lambda: summary)
    card = job_card(job)
    assert "Worth knowing:" in card and "<li>2 faces found; animated face 1 (the largest)</li>" in card
    assert "the &lt;speech&gt; is silent" in card  # escaped, as every word of a job is
    chinese = SimpleNamespace(headers={"accept-language": "zh-CN,zh;q=0.9,en;q=0.8"})
    assert language(chinese) == "zh" and language(SimpleNamespace(headers={"accept-language": "en-GB"})) == "en"
    assert language(SimpleNamespace()) == "en"  # no header: English
    card = job_card(job, language(chinese))
    assert "完成" in card and "请注意" in card and "找到 2 张人脸；第 1 张（最大的）在说话" in card
    assert "the &lt;speech&gt; is silent" in card  # words it has no other words for: as the job wrote them
    queued = SimpleNamespace(status="queued", jobs_ahead=1, seconds=None, progress=0.0, error=None, label=None,
                             id="20261206-2", read_summary=lambda: None)
    assert "Place in the queue: 2 (1 job ahead of it)" in job_card(queued)


def test_a_failed_jobs_card_names_the_job_and_where_its_log_is_and_its_stages_are_on_a_time_line():
    from heygem.ui.common import chart_update

    failed = SimpleNamespace(status="failed", seconds=2.0, engine="landmark", progress=0.4, label=None,
                             error="unexpected error (ValueError: boom); see job.log", id="20261206-3",
                             read_summary=lambda: None)
    card = job_card(failed)
    assert "job 20261206-3" in card and "unexpected error (ValueError: boom)" in card
    assert "Its log: the Jobs tab, job 20261206-3." in card
    assert "任务 20261206-3" in job_card(failed, "zh")
    assert chart_update(failed)["visible"] is False  # no summary: nothing drawn
    summary = {"total_seconds": 2.0, "seconds_per_stage": {"faces": 1.0, "encode": 1.5},
               "stage_spans": {"faces": [0.1, 1.1], "encode": [0.4, 1.9]}}
    done = SimpleNamespace(**{**vars(failed), "status": "done", "error": None, "read_summary": lambda: summary})
    drawn = chart_update(done)
    assert drawn["visible"] is True and "finding faces" in drawn["value"] and "2.0 s in all" in drawn["value"]
    assert "Its log" not in job_card(done)


def test_every_word_of_the_page_is_there_in_english_and_chinese():
    import re

    from heygem.ui.common import WORDS, page_i18n, say, ui_text

    for key, (english, chinese) in WORDS.items():
        assert english.strip() and chinese.strip(), key
        assert set(re.findall(r"{(\w+)", english)) == set(re.findall(r"{(\w+)", chinese)), key  # the same blanks
    translations = page_i18n().translations_dict
    assert translations["zh-CN"]["generate"] == "生成" and translations["en"]["generate"] == "Generate"
    assert say("height.360") == "360 px high" and say("card.after", "zh", seconds=2.0) == "2.0 秒后"
    with pytest.raises(KeyError):
        ui_text("no such words")
    from heygem.ui import generate

    source = Path(generate.__file__).read_text(encoding="utf-8")
    for key in re.findall(r'ui_text\("([^"{]+)"\)', source):  # every key the Generate tab asks for
        assert key in WORDS, key


def test_the_subtitles_go_to_the_players_as_webvtt(tmp_path):
    from heygem.speech.subtitles import Cue, format_vtt, write_srt
    from heygem.ui.generate import cues_html

    assert format_vtt([Cue(0.0, 1.25, "Hello  there."), Cue(61.5, 63.0, "a --> b")]) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.250\nHello there.\n\n00:01:01.500 --> 00:01:03.000\na -> b\n")
    job = SimpleNamespace(directory=tmp_path)
    assert cues_html(job) == ""  # no subtitles (yet)
    write_srt([Cue(0.0, 1.0, "<b>Hi</b> & bye")], tmp_path / "result.srt")
    assert cues_html(job) == ('<pre class="vtt">WEBVTT\n\n00:00:00.000 --&gt; 00:00:01.000\n'
                              '&lt;b&gt;Hi&lt;/b&gt; &amp; bye\n</pre>')  # the page reads it back as text


def test_a_photo_has_no_own_audio_to_use_and_heights_are_heights():
    from heygem.ui.common import OUTPUT_HEIGHTS, WORDS
    from heygem.ui.faces import preview_face

    image, video, own_audio = preview_face("/somewhere/me.jpg")
    assert image["visible"] and not video["visible"]
    assert own_audio["visible"] is False and own_audio["interactive"] is False and own_audio["value"] is False
    _, _, own_audio = preview_face("/somewhere/me.mp4")
    assert own_audio["visible"] and own_audio["interactive"]
    assert all(WORDS[f"height.{pixels}"][0] == f"{pixels} px high" for pixels in OUTPUT_HEIGHTS[1:])
    assert "the width keeps the face's shape" in WORDS["height"][0] and "270x360" in WORDS["height.info"][0]
