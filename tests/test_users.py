"""Users of a shared server (--users FILE): signing in, jobs owned by their submitter, a user seeing,
fetching, cancelling and deleting only their own jobs (others' answer 404), an admin seeing all; the
store's column added to an older jobs.db in place; deleting a finished job over REST and the CLI."""

from __future__ import annotations

import base64
import shutil
import sqlite3

import pytest
from conftest import ASSETS, run_ffmpeg

from heygem.errors import HeygemError
from heygem.jobs.store import DONE, JobStore, process_owner
from heygem.jobs.users import Users, hash_secret
from heygem.weights import weights_dir

USERS_FILE = """\
# who may use this server
admin alice:alice-secret
bob:bob-secret
carol:{carol_hash}
"""


def basic(name: str, secret: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{name}:{secret}".encode()).decode()}


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def users_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("users") / "users.txt"
    path.write_text(USERS_FILE.format(carol_hash=hash_secret("carol-secret", iterations=1000)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    path = tmp_path_factory.mktemp("users inputs") / "hello.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "0.6", str(path))
    return path


def test_the_users_file_names_users_roles_and_plain_or_hashed_secrets(users_path):
    users = Users.load(users_path)
    assert sorted(user.name for user in users) == ["alice", "bob", "carol"]
    assert users.check_password("alice", "alice-secret").admin
    assert not users.check_password("bob", "bob-secret").admin
    assert users.check_password("carol", "carol-secret").name == "carol"  # stored hashed
    assert "carol-secret" not in users_path.read_text()
    assert users.check_password("bob", "alice-secret") is None and users.check_password("dave", "x") is None
    assert users.check_key("bob-secret").name == "bob" and users.check_key("carol-secret").name == "carol"
    assert users.check_key("nobody's key") is None
    assert users.from_authorization(basic("carol", "carol-secret")["Authorization"]).name == "carol"
    assert users.from_authorization(bearer("alice-secret")["Authorization"]).name == "alice"
    assert users.from_authorization("Basic !!!") is None and users.from_authorization("") is None


@pytest.mark.parametrize(("text", "message"), [
    ("bob\n", "line 1: write NAME:SECRET"),
    ("bob:\n", "line 1: bob has no secret"),
    ("# fine\nbob:one\nbob:two\n", "line 3: bob is listed twice"),
    ("root bob:one\n", "line 1: write NAME:SECRET"),
    ("b o:one\n", "line 1"),
    ("alice:same\nbob:same\n", "line 2: bob has the same secret as alice"),
    ("\n# nobody\n", "lists no users"),
])
def test_a_bad_users_file_names_the_line_to_fix(tmp_path, text, message):
    path = tmp_path / "users.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(HeygemError, match=message):
        Users.load(path)


def test_a_missing_users_file_is_one_clear_error(tmp_path):
    with pytest.raises(HeygemError, match="users file"):
        Users.load(tmp_path / "absent.txt")


def make_done(store: JobStore, job_id: str) -> None:
    owner = process_owner("test")
    claimed = store.claim_next(owner)
    assert claimed is not None and claimed.id == job_id
    shutil.copyfile(ASSETS / "speech_en.wav", claimed.result_path)  # stands in for the video: bytes to compare
    assert store.finish(job_id, owner, DONE)


@pytest.fixture()
def served(tmp_path, users_path, speech):
    """The REST API over a store holding one job of bob's (done), one of carol's (queued) and one made
    without a user (the CLI's)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.jobs.api import create_router

    store = JobStore(tmp_path / "outputs")
    bobs = store.create_job(ASSETS / "astronaut.jpg", speech, submitter="bob")
    make_done(store, bobs)
    carols = store.create_job(ASSETS / "astronaut.jpg", speech, submitter="carol")
    nobodys = store.create_job(ASSETS / "astronaut.jpg", speech)
    app = FastAPI()
    app.include_router(create_router(store, users=Users.load(users_path)))
    with TestClient(app) as client:
        yield client, store, {"bob": bobs, "carol": carols, "none": nobodys}
    store.close()


def test_rest_needs_a_user_and_lists_only_their_jobs_while_an_admin_sees_all(served):
    client, _, ids = served
    assert client.get("/api/jobs").status_code == 401
    assert client.get("/api/jobs", headers=basic("bob", "wrong")).status_code == 401
    assert client.get("/api/jobs", headers=bearer("wrong")).status_code == 401
    bob = client.get("/api/jobs", headers=bearer("bob-secret")).json()
    assert [job["id"] for job in bob["jobs"]] == [ids["bob"]] and bob["jobs"][0]["submitter"] == "bob"
    assert bob["counts"]["done"] == 1 and bob["counts"]["queued"] == 0  # counts of their own jobs only
    carol = client.get("/api/jobs", headers=basic("carol", "carol-secret")).json()
    assert [job["id"] for job in carol["jobs"]] == [ids["carol"]]
    everyone = client.get("/api/jobs", headers=basic("alice", "alice-secret")).json()
    assert {job["id"] for job in everyone["jobs"]} == set(ids.values())


def test_another_users_job_answers_404_on_every_route(served):
    client, store, ids = served
    job = ids["bob"]
    as_carol = basic("carol", "carol-secret")
    for method, path in (("GET", f"/api/jobs/{job}"), ("GET", f"/api/jobs/{job}/result"),
                         ("GET", f"/api/jobs/{job}/log"), ("DELETE", f"/api/jobs/{job}"),
                         ("POST", f"/api/jobs/{job}/retry"), ("GET", f"/api/jobs/{job}/stream.m3u8"),
                         ("GET", f"/api/jobs/{job}/stream/0000-00000.ts"), ("GET", "/api/jobs/no-such-job")):
        response = client.request(method, path, headers=as_carol)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"] == f"there is no job {path.split('/')[3]!r}"  # the same words as no job
    assert store.find(job) is not None and store.get(job).status == DONE
    own = client.get(f"/api/jobs/{job}/result", headers=bearer("bob-secret"))
    assert own.status_code == 200 and own.content == (ASSETS / "speech_en.wav").read_bytes()
    log = client.get(f"/api/jobs/{job}/log", headers=bearer("bob-secret")).text
    assert "queued: face 'astronaut.jpg'" in log and str(store.outputs_dir) not in log
    admin = basic("alice", "alice-secret")
    assert client.get(f"/api/jobs/{ids['none']}", headers=admin).status_code == 200
    assert client.get(f"/api/jobs/{ids['none']}", headers=as_carol).status_code == 404


def test_a_job_response_and_its_log_show_no_server_paths_but_to_an_admin(served):
    client, store, ids = served
    text = client.get(f"/api/jobs/{ids['bob']}", headers=bearer("bob-secret")).text
    assert str(store.outputs_dir) not in text and "/tmp" not in text
    job = store.get(ids["bob"])
    with open(job.log_path, "a", encoding="utf-8") as log:  # as a worker's lines name the folders
        log.write(f"wrote {job.result_path}; no checkpoint in {weights_dir()}\n")
    own = client.get(f"/api/jobs/{job.id}/log", headers=bearer("bob-secret")).text
    assert "wrote <job folder>/result.mp4; no checkpoint in weights" in own
    assert str(store.outputs_dir) not in own and str(weights_dir()) not in own
    admin = client.get(f"/api/jobs/{job.id}/log", headers=bearer("alice-secret")).text
    assert f"wrote {job.result_path}" in admin


def test_a_submitted_job_belongs_to_its_submitter(served, speech):
    client, store, _ = served
    files = {"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes()),
             "audio": ("hello.wav", speech.read_bytes())}
    response = client.post("/api/jobs", files=files, headers=bearer("carol-secret"))
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert store.get(job_id).submitter == "carol"
    assert client.get(f"/api/jobs/{job_id}", headers=bearer("bob-secret")).status_code == 404
    assert client.get(f"/api/jobs/{job_id}", headers=bearer("carol-secret")).json()["submitter"] == "carol"


def test_delete_cancels_a_queued_job_then_deletes_it_with_its_files(served):
    client, store, ids = served
    as_carol = bearer("carol-secret")
    job = store.get(ids["carol"])
    cancelled = client.delete(f"/api/jobs/{job.id}", headers=as_carol)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert job.directory.is_dir()
    deleted = client.delete(f"/api/jobs/{job.id}", headers=as_carol)
    assert deleted.status_code == 200 and deleted.json() == {"id": job.id, "status": "deleted"}
    assert store.find(job.id) is None and not job.directory.exists()
    assert client.get(f"/api/jobs/{job.id}", headers=as_carol).status_code == 404
    done = store.get(ids["bob"])  # a done job goes at once
    assert client.delete(f"/api/jobs/{done.id}", headers=basic("alice", "alice-secret")).status_code == 200
    assert not done.directory.exists()


def test_an_older_jobs_db_gets_the_submitter_column_in_place(tmp_path, speech):
    outputs = tmp_path / "outputs"
    store = JobStore(outputs)
    job_id = store.create_job(ASSETS / "astronaut.jpg", speech)
    row = dict(store._connect().execute("SELECT * FROM jobs").fetchone())
    store.close()
    (outputs / "jobs.db").unlink()
    old_columns = [name for name in row if name not in ("worker", "device", "submitter")]
    with sqlite3.connect(outputs / "jobs.db") as db:  # the table as the first release made it
        db.execute(f"CREATE TABLE jobs ({', '.join(old_columns)})")
        db.execute(f"INSERT INTO jobs VALUES ({', '.join('?' * len(old_columns))})",
                   [row[name] for name in old_columns])
    reopened = JobStore(outputs)
    assert reopened.get(job_id).submitter is None
    columns = {row["name"] for row in reopened._connect().execute("PRAGMA table_info(jobs)")}
    assert {"submitter", "worker", "device"} <= columns
    mine = reopened.create_job(ASSETS / "astronaut.jpg", speech, submitter="bob")
    assert [job.id for job in reopened.list(submitter="bob")] == [mine]
    assert reopened.counts(submitter="bob")["queued"] == 1 and reopened.counts()["queued"] == 2
    reopened.close()


def test_the_cli_deletes_a_finished_job_and_its_folder(tmp_path, speech, capsys):
    from heygem.cli import main

    outputs = tmp_path / "outputs"
    store = JobStore(outputs)
    job_id = store.create_job(ASSETS / "astronaut.jpg", speech)
    make_done(store, job_id)
    running = store.create_job(ASSETS / "astronaut.jpg", speech)
    store.claim_next(process_owner("test"))
    assert main(["jobs", "delete", running, "--outputs", str(outputs)]) == 2
    assert "is running: cancel it first" in capsys.readouterr().err
    store.create_job(ASSETS / "astronaut.jpg", speech, submitter="carol")
    assert main(["jobs", "list", "--outputs", str(outputs)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split()[:6] == ["id", "status", "progress", "engine", "device", "user"]
    assert sum(" carol " in line for line in listed) == 1
    assert main(["jobs", "--outputs", str(outputs), "delete", job_id]) == 0
    assert f"{job_id}: deleted" in capsys.readouterr().out
    assert store.find(job_id) is None and not (outputs / job_id).exists()
    assert main(["jobs", "delete", "20990101-000000-abcdef", "--outputs", str(outputs)]) == 2
    assert "there is no job" in capsys.readouterr().err
    store.close()


def test_hash_secret_makes_a_line_the_users_file_takes(tmp_path, capsys):
    from heygem.cli import main

    assert main(["users", "hash", "--secret", "s3cret"]) == 0
    hashed = capsys.readouterr().out.strip()
    assert hashed.startswith("pbkdf2_sha256$") and "s3cret" not in hashed
    (tmp_path / "users.txt").write_text(f"dave:{hashed}\n", encoding="utf-8")
    assert Users.load(tmp_path / "users.txt").check_password("dave", "s3cret").name == "dave"
