"""--voice clone end to end: typed text spoken in the voice of the face video's own sound (or of a voice
sample) by random-init VibeVoice files that speak exactly FRAMES frames per sentence, through the
command line and REST; consent required, missing files explained, the MP4 and the summary saying
which voice and model spoke."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from conftest import ASSETS, REPO, run_ffmpeg
from faults import Server

from heygem.media.ffmpeg import ffmpeg_binary
from heygem.media.probing import probe
from heygem.speech.clone_files import write_random_files

FRAMES = 6  # per sentence: 0.8 s at 3200 samples a frame, 24 kHz
TEXT = "Hello there. Nice to meet you."  # two sentences
SPOKEN_SECONDS = 2 * FRAMES * 3200 / 24000 + 0.3  # and the pause between them
OPTIONS = {"engine.name": "landmark", "media.output_height": 192}


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("clone weights")
    write_random_files(folder / "vibevoice", size="reduced", seed=0, shard_size="300KB", frames_per_sentence=FRAMES)
    return folder


@pytest.fixture(scope="module")
def presenter(tmp_path_factory) -> Path:
    """A presenter video whose own sound is speech (the bundled English sample)."""
    path = tmp_path_factory.mktemp("clone inputs") / "presenter.mp4"
    run_ffmpeg("-loop", "1", "-framerate", "25", "-i", str(ASSETS / "astronaut.jpg"),
               "-i", str(ASSETS / "speech_en.wav"), "-vf", "scale=256:-2,format=yuv420p", "-c:v", "libx264",
               "-preset", "ultrafast", "-c:a", "aac", "-shortest", str(path))
    return path


def heygem(*args: str, weights_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HEYGEM_WEIGHTS=str(weights_dir), HEYGEM_CACHE_DIR=str(tmp_path / "cache"),
               HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "heygem", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)


def comment_of(path: Path) -> str:
    import av

    with av.open(str(path)) as container:
        return container.metadata.get("comment", "")


def decoded_audio(path: Path, rate: int = 24000) -> np.ndarray:
    result = subprocess.run([ffmpeg_binary(), "-nostdin", "-v", "error", "-i", str(path), "-map", "0:a:0", "-ac", "1",
                             "-ar", str(rate), "-f", "f32le", "pipe:"], capture_output=True, check=True)
    return np.frombuffer(result.stdout, np.float32)


def wav_samples(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path)) as file:
        pcm = np.frombuffer(file.readframes(file.getnframes()), "<i2")
        return pcm.astype(np.float32) / 32768.0, file.getframerate()


def assert_cloned_output(output: Path) -> None:
    """The MP4 lasts as long as the model spoke, its audio is that speech, and it says who spoke."""
    info = probe(output)
    assert info.has_audio and abs(info.duration - SPOKEN_SECONDS) < 0.15, info.duration
    speech, rate = wav_samples(output.with_suffix(".wav"))
    assert rate == 24000 and abs(len(speech) / rate - SPOKEN_SECONDS) < 1e-3
    sound = decoded_audio(output)[: len(speech)]
    correlation = np.corrcoef(sound, speech[: len(sound)])[0, 1]
    assert correlation > 0.8, correlation  # the MP4 carries the generated speech (through AAC)
    assert comment_of(output) == "voice: clone, model: VibeVoice-1.5B"


def test_the_command_line_speaks_in_the_face_video_s_own_voice(weights, presenter, tmp_path):
    output = tmp_path / "cloned.mp4"
    result = heygem("generate", "--face", str(presenter), "--text", TEXT, "--voice", "clone", "--voice-consent",
                    "--engine", "landmark", "--output", str(output), weights_dir=weights, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert_cloned_output(output)
    summary = json.loads(output.with_suffix(".json").read_text())
    assert summary["voice"] == "clone" and summary["voice_model"] == "VibeVoice-1.5B"
    assert "Nice to meet you." in output.with_suffix(".srt").read_text(encoding="utf-8")


def test_a_photo_speaks_in_the_voice_of_a_voice_sample(weights, tmp_path):
    output = tmp_path / "photo.mp4"
    args = ["generate", "--face", str(ASSETS / "astronaut.jpg"), "--text", TEXT, "--voice", "clone", "--voice-consent",
            "--engine", "landmark", "--output", str(output)]
    refused = heygem(*args, weights_dir=weights, tmp_path=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "no sound" in refused.stderr and "--voice-sample" in refused.stderr
    result = heygem(*args, "--voice-sample", str(ASSETS / "speech_zh.wav"), weights_dir=weights, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_cloned_output(output)


def test_without_consent_the_cloned_voice_is_refused(weights, presenter, tmp_path):
    result = heygem("generate", "--face", str(presenter), "--text", TEXT, "--voice", "clone",
                    "--output", str(tmp_path / "x.mp4"), weights_dir=weights, tmp_path=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "consent" in lines[0] and "--voice-consent" in lines[0]
    assert not (tmp_path / "x.mp4").exists()


def test_without_the_files_the_cloned_voice_says_where_they_go(presenter, tmp_path):
    result = heygem("generate", "--face", str(presenter), "--text", TEXT, "--voice", "clone", "--voice-consent",
                    "--output", str(tmp_path / "x.mp4"), weights_dir=tmp_path / "empty", tmp_path=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "weights/vibevoice/" in lines[0] and "config.json" in lines[0]


def test_piper_stays_the_default_and_the_voice_list_names_clone(weights, tmp_path):
    from heygem.speech.tts import choose_voice, list_voices

    assert choose_voice("Hello.", None, weights).voice.kind == "piper"
    clone_voices = [voice for voice in list_voices(weights) if voice.name == "clone"]
    assert len(clone_voices) == 1 and clone_voices[0].sample_rate == 24000
    assert "clone" not in [voice.name for voice in list_voices(tmp_path)]
    listed = heygem("voices", weights_dir=weights, tmp_path=tmp_path)
    assert listed.returncode == 0 and any(line.split()[:2] == ["clone", "clone"] for line in listed.stdout.splitlines())


def test_the_cloned_voice_keeps_its_own_pace(weights):
    from heygem.errors import HeygemError
    from heygem.speech.tts import choose_voice, clone_voice, stream_sentences

    choice = choose_voice("Hello.", clone_voice(weights, ASSETS / "speech_en.wav"))
    with pytest.raises(HeygemError, match="speed"):
        next(stream_sentences("Hello.", choice, speed=1.5))


@pytest.fixture(scope="module")
def server(tmp_path_factory, weights):
    folder = tmp_path_factory.mktemp("clone app")
    live = Server(folder / "outputs", folder / "app.log",
                  env={"HEYGEM_WEIGHTS": str(weights), "HF_HUB_OFFLINE": "1",
                       "HEYGEM_CACHE_DIR": str(folder / "cache")}).wait_ready()
    yield live
    live.stop()


def wait_done(server, job_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = server.client.get(f"/api/jobs/{job_id}").json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not finished: {server.log_text()[-2000:]}")


def cloned_job_folder(server, response) -> Path:
    """The folder of the job ``response`` queued, once it is done, its output checked as a cloned voice's."""
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    job = wait_done(server, job_id)
    assert job["status"] == "done", (job, server.log_text()[-3000:])
    folder = server.outputs / job_id
    assert_cloned_output_of_job(folder)
    return folder


def test_rest_needs_consent_and_speaks_in_the_uploaded_voice(server):
    face = ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes())
    sample = ("me speaking.wav", (ASSETS / "speech_en.wav").read_bytes())
    data = {"text": TEXT, "voice": "clone", "options": json.dumps(OPTIONS)}
    refused = server.client.post("/api/jobs", files={"face": face, "voice_sample": sample}, data=data)
    assert refused.status_code == 400 and "consent" in refused.json()["error"]
    no_sound = server.client.post("/api/jobs", files={"face": face}, data={**data, "voice_consent": "true"})
    assert no_sound.status_code == 400 and "voice_sample" in no_sound.json()["error"]
    not_a_file = server.client.post("/api/jobs", files={"face": face},
                                    data={**data, "voice_consent": "true", "voice_sample": "me.wav"})
    assert not_a_file.status_code == 400 and "must be a file" in not_a_file.json()["error"]
    silence = ("quiet.wav", silent_wav_bytes())
    no_speech = server.client.post("/api/jobs", files={"face": face, "voice_sample": silence},
                                   data={**data, "voice_consent": "true"})
    assert no_speech.status_code == 400 and "quiet.wav" in no_speech.json()["error"]
    assert "silence" in no_speech.json()["error"]
    response = server.client.post("/api/jobs", files={"face": face, "voice_sample": sample},
                                  data={**data, "voice_consent": "true"})
    cloned_job_folder(server, response)


def test_a_presenter_speaks_in_its_own_kept_voice_sample(server, presenter):
    """A job made from a saved presenter with the cloned voice and no sample takes the speech sample the
    presenter kept when it was prepared."""
    made = server.client.post("/api/presenters", files={"video": ("anna.mp4", presenter.read_bytes())},
                              data={"name": "Anna"})
    assert made.status_code == 201, made.text
    presenter_id = made.json()["id"]
    deadline = time.monotonic() + 120
    while server.client.get(f"/api/presenters/{presenter_id}").json()["status"] == "preparing":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    kept = server.client.get(f"/api/presenters/{presenter_id}/speech")
    assert kept.status_code == 200 and len(kept.content) > 24000 * 2 * 5  # 5 s or more of 16-bit speech
    fields = {"presenter": presenter_id, "text": TEXT, "voice": "clone", "voice_consent": "true",
              "options": json.dumps(OPTIONS)}  # as curl -F sends them: multipart, no file
    response = server.client.post("/api/jobs", files={name: (None, value) for name, value in fields.items()})
    folder = cloned_job_folder(server, response)
    samples = [path for path in folder.iterdir() if path.name.startswith("voice_sample")]
    assert [path.read_bytes() for path in samples] == [kept.content]


def test_gradio_client_needs_consent_and_speaks_in_the_sample_voice(server):
    from gradio_client import Client, handle_file

    client = Client(server.url, verbose=False)
    asked = {"face": handle_file(str(ASSETS / "astronaut.jpg")), "text": TEXT, "voice": "clone",
             "voice_sample": handle_file(str(ASSETS / "speech_en.wav")), "options": json.dumps(OPTIONS)}
    with pytest.raises(Exception, match="consent"):
        client.predict(**asked, api_name="/submit_job")
    job_id = client.predict(**asked, voice_consent=True, api_name="/submit_job")
    job = wait_done(server, job_id)
    assert job["status"] == "done", (job, server.log_text()[-3000:])
    assert_cloned_output_of_job(server.outputs / job_id)


def silent_wav_bytes(seconds: float = 8.0) -> bytes:
    import io

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(24000)
        file.writeframes(bytes(2 * int(seconds * 24000)))
    return buffer.getvalue()


def assert_cloned_output_of_job(folder: Path) -> None:
    info = probe(folder / "result.mp4")
    assert info.has_audio and abs(info.duration - SPOKEN_SECONDS) < 0.15, info.duration
    assert comment_of(folder / "result.mp4") == "voice: clone, model: VibeVoice-1.5B"
    summary = json.loads((folder / "result.json").read_text())
    assert summary["voice"] == "clone" and summary["voice_model"] == "VibeVoice-1.5B"
    speech, rate = wav_samples(folder / "speech.wav")
    assert rate == 24000 and abs(len(speech) / rate - SPOKEN_SECONDS) < 1e-3


def test_say_speaks_in_the_voice_of_a_sample_with_consent(weights, tmp_path):
    output = tmp_path / "said.wav"
    args = ["say", TEXT, "--voice", "clone", "--voice-sample", str(ASSETS / "speech_en.wav"), "-o", str(output)]
    refused = heygem(*args, weights_dir=weights, tmp_path=tmp_path)
    assert refused.returncode == 2 and "consent" in refused.stderr and not output.exists()
    result = heygem(*args, "--voice-consent", weights_dir=weights, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    speech, rate = wav_samples(output)
    assert rate == 24000 and abs(len(speech) / rate - SPOKEN_SECONDS) < 1e-3 and speech.std() > 1e-3


def test_a_job_rendered_from_finished_speech_says_the_cloned_voice_spoke(weights, presenter, tmp_path, monkeypatch):
    """The path of a renderer that takes a finished speech file (a Ray node): the whole text is spoken
    first (heygem.jobs.speech.speak_whole), in the voice of the face video's own sound."""
    from heygem.jobs.store import JobStore, process_owner
    from heygem.jobs.worker import run_job
    from heygem.pipeline import generate

    monkeypatch.setenv("HEYGEM_WEIGHTS", str(weights))
    monkeypatch.setenv("HEYGEM_CACHE_DIR", str(tmp_path / "cache"))
    store = JobStore(tmp_path / "outputs")
    job_id = store.create_job(presenter, None, OPTIONS, text=TEXT, voice="clone", voice_consent=True)
    owner = process_owner("test")
    job = store.claim_next(owner)
    assert job.id == job_id
    assert run_job(store, job, owner, generate=generate) == "done", job.log_path.read_text()
    assert_cloned_output_of_job(job.directory)


@pytest.mark.parametrize("mode", ["soft", "burn"])
def test_subtitles_keep_the_voice_in_the_metadata(tmp_path, mode):
    from heygem.media.encode import comment_args, run_ffmpeg_to_end
    from heygem.speech.subtitles import Cue, add_subtitles, write_srt

    plain, video = tmp_path / "plain.mp4", tmp_path / "tagged.mp4"
    run_ffmpeg("-loop", "1", "-framerate", "25", "-t", "1", "-i", str(ASSETS / "astronaut.jpg"),
               "-i", str(ASSETS / "speech_en.wav"), "-t", "1", "-vf", "scale=128:-2,format=yuv420p",
               "-c:v", "libx264", "-preset", "ultrafast", "-c:a", "aac", str(plain))
    assert run_ffmpeg_to_end(comment_args(plain, video, "voice: clone, model: VibeVoice-1.5B")) is None
    cues = [Cue(0.0, 0.8, "Hello there.")]
    add_subtitles(video, write_srt(cues, tmp_path / "cues.srt"), cues, mode)
    assert comment_of(video) == "voice: clone, model: VibeVoice-1.5B"


def test_a_batch_row_of_a_presenter_speaks_in_its_kept_voice(weights, presenter, tmp_path, monkeypatch):
    """A manifest row naming a saved presenter, spoken by the cloned voice (the batch's --voice clone with
    consent), takes the speech sample the presenter kept."""
    from heygem.jobs.batch import run_batch
    from heygem.presenters.prepare import prepare
    from heygem.presenters.records import PresenterStore

    monkeypatch.setenv("HEYGEM_WEIGHTS", str(weights))
    jobs = tmp_path / "jobs"
    presenters = PresenterStore(jobs)
    made = prepare(presenters, presenters.create(presenter, "Anna"))
    assert made.sample_path is not None and made.sample_path.is_file()
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "rows.csv").write_text(f"presenter,audio,text,name\nAnna,,{TEXT},greeting\n", encoding="utf-8")
    results = run_batch(inputs, tmp_path / "out", "rows.csv", OPTIONS, jobs_dir=jobs, show_progress=False,
                        voice="clone", voice_consent=True)
    assert [(result.item.name, result.status) for result in results] == [("greeting", "done")], results
    assert_cloned_output_of_job(jobs / results[0].job_id)
    samples = sorted((jobs / results[0].job_id).glob("voice_sample*"))
    assert [path.read_bytes() for path in samples] == [made.sample_path.read_bytes()]
