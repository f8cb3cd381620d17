"""What a server lets in, at every door: a retried job passes the same queue and disk checks as a new one,
the Batch tab's server folders stay inside their roots, and the command line refuses outputs and inputs
it cannot use with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ASSETS, rest_client

from heygem.jobs.limits import JobLimits
from heygem.jobs.store import JobStore

FACE = ASSETS / "astronaut.jpg"


@pytest.fixture(scope="module")
def speech(second_of_speech) -> Path:
    return second_of_speech


def post_job(client, speech: Path, face: Path = FACE):
    return client.post("/api/jobs", files={"face": (face.name, face.read_bytes()),
                                           "audio": (speech.name, speech.read_bytes())}, data={"options": "{}"})


# ---------------------------------------------------------------------- retry is admitted as a new job


def test_a_retry_counts_against_max_queued(tmp_path, speech):
    store = JobStore(tmp_path / "outputs", limits=JobLimits(max_queued=3))
    client = rest_client(store)
    first = [post_job(client, speech).json()["id"] for _ in range(3)]
    for job_id in first:
        assert client.delete(f"/api/jobs/{job_id}").json()["status"] == "cancelled"
    assert [post_job(client, speech).status_code for _ in range(3)] == [201] * 3
    answers = [client.post(f"/api/jobs/{job_id}/retry") for job_id in first]
    assert [answer.status_code for answer in answers] == [429] * 3, [answer.text for answer in answers]
    assert answers[0].headers["Retry-After"] == "60"
    assert "waiting" in answers[0].json()["error"]
    assert store.counts()["queued"] == 3 and store.counts()["cancelled"] == 3


def test_a_retry_needs_the_free_disk_a_new_job_needs(tmp_path, speech):
    store = JobStore(tmp_path / "outputs")
    client = rest_client(store)
    job_id = post_job(client, speech).json()["id"]
    client.delete(f"/api/jobs/{job_id}")
    store.limits = JobLimits(min_free_bytes=1 << 60)  # more than any disk has
    answer = client.post(f"/api/jobs/{job_id}/retry")
    assert answer.status_code == 507, answer.text
    assert "disk" in answer.json()["error"]
    assert store.get(job_id).status == "cancelled"


# ---------------------------------------------------------------------- the Batch tab's server folders


@pytest.fixture()
def folder_with_links(tmp_path, speech) -> Path:
    """A batch root holding one real pair and links to another user's files outside it."""
    import shutil

    elsewhere = tmp_path / "another user's job"
    elsewhere.mkdir()
    shutil.copy(FACE, elsewhere / "secret.jpg")
    shutil.copy(speech, elsewhere / "secret.wav")
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(FACE, root / "mine.jpg")
    shutil.copy(speech, root / "mine.wav")
    (root / "stolen.jpg").symlink_to(elsewhere / "secret.jpg")
    (root / "stolen.wav").symlink_to(elsewhere / "secret.wav")
    return root


@pytest.mark.parametrize("pairing", ["stem", "cross"])
def test_a_server_folder_never_pairs_a_file_that_links_outside_it(tmp_path, folder_with_links, pairing):
    from heygem.jobs.batch import collect_files, plan_items, submit_items

    items = plan_items(collect_files(folder_with_links), pairing, base_dir=folder_with_links)
    runnable = [item for item in items if not item.problem]
    used = {path.name for item in runnable for path in (item.face_path, item.audio_path) if path is not None}
    assert used == {"mine.jpg", "mine.wav"}, items
    refused = [item.problem for item in items if "stolen" in (item.problem or "")]
    assert len(refused) == 2 and all("outside the batch folder" in problem for problem in refused), refused
    store = JobStore(tmp_path / "outputs")
    outcome = submit_items(store, items, {}, "batch", remote=True)
    queued = [store.get(value) for value in outcome.values() if isinstance(value, str)]
    assert [(job.face_name, job.audio_name) for job in queued] == [("mine.jpg", "mine.wav")]


# ---------------------------------------------------------------------- the command line's files


def heygem(*args, timeout: float = 300):
    import subprocess
    import sys

    from conftest import REPO

    return subprocess.run([sys.executable, "-m", "heygem", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def one_line_exit_2(result, words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if "%|" not in line]  # not the progress bars
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr


@pytest.mark.parametrize("clash", ["face", "audio", "summary beside it"])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(tmp_path, speech, clash):
    import shutil

    face, audio = tmp_path / "f.jpg", tmp_path / "a.wav"
    shutil.copy(FACE, face)
    shutil.copy(speech, audio)
    before = face.read_bytes(), audio.read_bytes()
    output = {"face": face, "audio": tmp_path / "." / "a.wav", "summary beside it": tmp_path / "a.json"}[clash]
    if clash == "summary beside it":
        audio = audio.rename(tmp_path / "a.json")
    one_line_exit_2(heygem("generate", "-o", output, "--face", face, "--audio", audio), "input")
    assert (face.read_bytes(), audio.read_bytes()) == before


def test_an_output_that_is_a_folder_is_one_line(tmp_path, speech):
    (tmp_path / "videos").mkdir()
    one_line_exit_2(heygem("generate", "-o", tmp_path / "videos", "--face", FACE, "--audio", speech), "folder")


@pytest.mark.parametrize("kind, words", [("folder", "is a folder"), ("fifo", "not a regular file"),
                                         ("device", "not a regular file")])
def test_an_input_that_is_no_file_says_what_it_is(tmp_path, speech, kind, words):
    import os

    if kind == "folder":
        path = tmp_path / "faces.jpg"
        path.mkdir()
    elif kind == "fifo":
        path = tmp_path / "pipe.wav"
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    result = heygem("generate", "-o", tmp_path / "out.mp4", "--face", FACE, "--audio", path)
    one_line_exit_2(result, words)
    from heygem.jobs.files import store_input

    with pytest.raises(Exception, match=words):
        store_input(path, tmp_path, "audio", set())


def test_a_text_file_is_read_no_further_than_its_limit(tmp_path):
    """/dev/zero never ends: the command reads the limit and one character more, then refuses it."""
    result = heygem("generate", "-o", tmp_path / "out.mp4", "--face", FACE, "--text-file", "/dev/zero",
                    "--max-text-chars", "100", timeout=120)
    one_line_exit_2(result, "100")


# ---------------------------------------------------------------------- REST's rough edges


@pytest.mark.parametrize("character", ["\u0085", "\u2028", "\u2029"])
def test_an_upload_name_with_a_unicode_line_break_is_refused(tmp_path, speech, character):
    store = JobStore(tmp_path / "outputs")
    answer = rest_client(store).post("/api/jobs", files={"face": (f"face{character}x.jpg", FACE.read_bytes()),
                                                         "audio": (speech.name, speech.read_bytes())})
    assert answer.status_code == 400, answer.text
    assert "control characters" in answer.json()["error"]
    assert store.list() == []


@pytest.mark.parametrize("query", ["limit=abc", "limit=1e999", "limit="])
def test_a_bad_query_parameter_is_a_400_with_an_error_line(tmp_path, query):
    answer = rest_client(JobStore(tmp_path / "outputs")).get(f"/api/jobs?{query}")
    assert answer.status_code == 400, answer.text
    assert set(answer.json()) == {"error"} and "limit" in answer.json()["error"], answer.json()
    assert "\n" not in answer.json()["error"]


def test_a_face_index_past_the_faces_found_says_how_many_there_are(tmp_path, speech):
    result = heygem("generate", "-o", tmp_path / "out.mp4", "--face", FACE, "--audio", speech, "--face-index", "3")
    one_line_exit_2(result, "face_index 3: only 1 face was found")
    assert not (tmp_path / "out.mp4").exists()


@pytest.mark.parametrize("options, words", [
    ({"engine.name": "wav2lip"}, "Wav2Lip checkpoint"),
    ({"restore.method": "gfpgan", "restore.enabled": True}, "GFPGANv1.4.pth"),
    ({"face.detector": "s3fd"}, "s3fd.pth"),
])
def test_a_missing_weights_file_is_refused_at_the_door_in_a_remote_clients_words(tmp_path, speech, no_weights,
                                                                                   options, words):
    import json

    store = JobStore(tmp_path / "outputs")
    answer = rest_client(store).post("/api/jobs", files={"face": (FACE.name, FACE.read_bytes()),
                                                         "audio": (speech.name, speech.read_bytes())},
                                     data={"options": json.dumps(options)})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert words in error and "server" in error, error
    assert str(no_weights) not in error and "--" not in error and "python -m" not in error, error
    assert store.list() == []
