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
admin alice:alice-long-secret
bob:bob-long-secret
carol:{carol_hash}
"""


def basic(name: str, secret: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{name}:{secret}".encode()).decode()}


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(scope="module")
def users_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("users") / "users.txt"
    path.write_text(USERS_FILE.format(carol_hash=hash_secret("carol-long-secret", iterations=1000)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    path = tmp_path_factory.mktemp("users inputs") / "hello.wav"
    run_ffmpeg("-i", str(ASSETS / "speech_en.wav"), "-t", "0.6", str(path))
    return path


def test_the_users_file_names_users_roles_and_plain_or_hashed_secrets(users_path):
    users = Users.load(users_path)
    assert sorted(user.name for user in users) == ["alice", "bob", "carol"]
    assert users.check_password("alice", "alice-long-secret").admin
    assert not users.check_password("bob", "bob-long-secret").admin
    assert users.check_password("carol", "carol-long-secret").name == "carol"  # stored hashed
    assert "carol-long-secret" not in users_path.read_text()
    assert users.check_password("bob", "alice-long-secret") is None and users.check_password("dave", "x") is None
    assert users.check_key("bob-long-secret").name == "bob"  # a plain secret alone
    assert users.check_key("carol:carol-long-secret").name == "carol"  # NAME:SECRET, for every user
    assert users.check_key("bob:bob-long-secret").name == "bob"
    assert users.check_key("carol-long-secret") is None  # a hashed secret's key names its user
    assert users.check_key("nobody's key") is None and users.check_key("bob:alice-long-secret") is None
    assert users.from_authorization(basic("carol", "carol-long-secret")["Authorization"]).name == "carol"
    assert users.from_authorization(bearer("alice-long-secret")["Authorization"]).name == "alice"
    assert users.from_authorization("Basic !!!") is None and users.from_authorization("") is None


@pytest.mark.parametrize(("text", "message"), [
    ("bob\n", "line 1: write NAME:SECRET"),
    ("bob:\n", "line 1: bob has no secret"),
    ("# fine\nbob:one-long-secret\nbob:two-long-secret\n", "line 3: bob is listed twice"),
    ("root bob:one-long-secret\n", "line 1: write NAME:SECRET"),
    ("b o:one-long-secret\n", "line 1"),
    ("alice:same-long-secret\nbob:same-long-secret\n", "line 2: bob has the same secret as alice"),
    ("\n# nobody\n", "lists no users"),
    ("alice:a-long-secret\nbob:eleven-char\n", "line 2: bob's secret is shorter than 12 characters"),
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
    bob = client.get("/api/jobs", headers=bearer("bob-long-secret")).json()
    assert [job["id"] for job in bob["jobs"]] == [ids["bob"]] and bob["jobs"][0]["submitter"] == "bob"
    assert bob["counts"]["done"] == 1 and bob["counts"]["queued"] == 0  # counts of their own jobs only
    carol = client.get("/api/jobs", headers=basic("carol", "carol-long-secret")).json()
    assert [job["id"] for job in carol["jobs"]] == [ids["carol"]]
    everyone = client.get("/api/jobs", headers=basic("alice", "alice-long-secret")).json()
    assert {job["id"] for job in everyone["jobs"]} == set(ids.values())


def test_another_users_job_answers_404_on_every_route(served):
    client, store, ids = served
    job = ids["bob"]
    as_carol = basic("carol", "carol-long-secret")
    for method, path in (("GET", f"/api/jobs/{job}"), ("GET", f"/api/jobs/{job}/result"),
                         ("GET", f"/api/jobs/{job}/log"), ("DELETE", f"/api/jobs/{job}"),
                         ("POST", f"/api/jobs/{job}/retry"), ("GET", f"/api/jobs/{job}/stream.m3u8"),
                         ("GET", f"/api/jobs/{job}/stream/0000-00000.ts"), ("GET", "/api/jobs/no-such-job")):
        response = client.request(method, path, headers=as_carol)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"] == f"there is no job {path.split('/')[3]!r}"  # the same words as no job
    assert store.find(job) is not None and store.get(job).status == DONE
    own = client.get(f"/api/jobs/{job}/result", headers=bearer("bob-long-secret"))
    assert own.status_code == 200 and own.content == (ASSETS / "speech_en.wav").read_bytes()
    log = client.get(f"/api/jobs/{job}/log", headers=bearer("bob-long-secret")).text
    assert "queued: face 'astronaut.jpg'" in log and str(store.outputs_dir) not in log
    admin = basic("alice", "alice-long-secret")
    assert client.get(f"/api/jobs/{ids['none']}", headers=admin).status_code == 200
    assert client.get(f"/api/jobs/{ids['none']}", headers=as_carol).status_code == 404


def test_a_job_response_and_its_log_show_no_server_paths_but_to_an_admin(served):
    client, store, ids = served
    text = client.get(f"/api/jobs/{ids['bob']}", headers=bearer("bob-long-secret")).text
    assert str(store.outputs_dir) not in text and "/tmp" not in text
    job = store.get(ids["bob"])
    with open(job.log_path, "a", encoding="utf-8") as log:  # as a worker's lines name the folders
        log.write(f"wrote {job.result_path}; no checkpoint in {weights_dir()}\n")
    own = client.get(f"/api/jobs/{job.id}/log", headers=bearer("bob-long-secret")).text
    assert "wrote <job folder>/result.mp4; no checkpoint in weights" in own
    assert str(store.outputs_dir) not in own and str(weights_dir()) not in own
    admin = client.get(f"/api/jobs/{job.id}/log", headers=bearer("alice-long-secret")).text
    assert f"wrote {job.result_path}" in admin


def test_a_submitted_job_belongs_to_its_submitter(served, speech):
    client, store, _ = served
    files = {"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes()),
             "audio": ("hello.wav", speech.read_bytes())}
    response = client.post("/api/jobs", files=files, headers=bearer("carol:carol-long-secret"))
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert store.get(job_id).submitter == "carol"
    assert client.get(f"/api/jobs/{job_id}", headers=bearer("bob-long-secret")).status_code == 404
    assert client.get(f"/api/jobs/{job_id}", headers=bearer("carol:carol-long-secret")).json()["submitter"] == "carol"


def test_delete_cancels_a_queued_job_then_deletes_it_with_its_files(served):
    client, store, ids = served
    as_carol = bearer("carol:carol-long-secret")
    job = store.get(ids["carol"])
    cancelled = client.delete(f"/api/jobs/{job.id}", headers=as_carol)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert job.directory.is_dir()
    deleted = client.delete(f"/api/jobs/{job.id}", headers=as_carol)
    assert deleted.status_code == 200 and deleted.json() == {"id": job.id, "status": "deleted"}
    assert store.find(job.id) is None and not job.directory.exists()
    assert client.get(f"/api/jobs/{job.id}", headers=as_carol).status_code == 404
    done = store.get(ids["bob"])  # a done job goes at once
    assert client.delete(f"/api/jobs/{done.id}", headers=basic("alice", "alice-long-secret")).status_code == 200
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

    assert main(["users", "hash", "--secret", "s3cret-s3cret"]) == 0
    hashed = capsys.readouterr().out.strip()
    assert hashed.startswith("pbkdf2_sha256$") and "s3cret" not in hashed
    (tmp_path / "users.txt").write_text(f"dave:{hashed}\n", encoding="utf-8")
    assert Users.load(tmp_path / "users.txt").check_password("dave", "s3cret-s3cret").name == "dave"
    assert main(["users", "hash", "--secret", "s3cret"]) == 2
    assert "shorter than 12 characters" in capsys.readouterr().err


# ---------------------------------------------------------------------- signing in, defended

HASHED_USERS = {"alice": "alice-long-secret", "bob": "bob-long-secret", "carol": "carol-long-secret"}


@pytest.fixture()
def hashed_users_path(tmp_path):
    """A users file whose three secrets are all hashed (few iterations: the count of runs is what is checked)."""
    path = tmp_path / "hashed-users.txt"
    path.write_text("".join(f"{'admin ' if name == 'alice' else ''}{name}:{hash_secret(secret, iterations=1000)}\n"
                            for name, secret in HASHED_USERS.items()), encoding="utf-8")
    return path


@pytest.fixture()
def hash_runs(monkeypatch):
    """Every PBKDF2 run from now on: (its iterations, whether it ran on a thread with a running event loop)."""
    import asyncio
    import hashlib

    runs = []
    real = hashlib.pbkdf2_hmac

    def counted(name, password, salt, iterations, *args):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        runs.append((iterations, on_loop))
        return real(name, password, salt, iterations, *args)

    monkeypatch.setattr(hashlib, "pbkdf2_hmac", counted)
    return runs


def rest_client(path_or_users, **router_options):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from heygem.jobs.api import create_router

    store = JobStore(router_options.pop("outputs"))
    users = Users.load(path_or_users) if not isinstance(path_or_users, Users) else path_or_users
    return TestClient(FastAPI(routes=create_router(store, users=users, **router_options).routes)), store


def test_a_wrong_key_costs_at_most_one_hash_whatever_it_is(hashed_users_path, hash_runs):
    users = Users.load(hashed_users_path)
    for key in ("a-random-key-of-nobody", "carol:not-carols-secret", "nobody:not-a-secret", "carol-long-secret"):
        hash_runs.clear()
        assert users.from_authorization(f"Bearer {key}") is None
        assert len(hash_runs) <= 1, (key, hash_runs)
    hash_runs.clear()
    assert users.from_authorization("Bearer carol:carol-long-secret").name == "carol"
    assert len(hash_runs) == 1


def test_the_rest_api_checks_secrets_off_the_event_loop_one_hash_a_request(tmp_path, hashed_users_path, hash_runs):
    client, store = rest_client(hashed_users_path, outputs=tmp_path / "outputs")
    for _ in range(3):
        assert client.get("/api/jobs", headers=bearer("a-random-key-of-nobody")).status_code == 401
    assert len(hash_runs) <= 3
    hash_runs.clear()
    assert client.get("/api/jobs", headers=basic("bob", "bob-long-secret")).status_code == 200
    assert client.get("/api/jobs", headers=bearer("bob:bob-long-secret")).status_code == 200  # remembered
    assert len(hash_runs) == 1 and not any(on_loop for _, on_loop in hash_runs)
    store.close()


def test_wrong_secrets_never_push_a_right_one_out_of_memory(hashed_users_path, hash_runs, monkeypatch):
    import heygem.jobs.users as users_module

    monkeypatch.setattr(users_module, "MAX_REMEMBERED", 8)
    users = Users.load(hashed_users_path)
    assert users.check_password("bob", "bob-long-secret").name == "bob"
    for number in range(30):  # wrong keys and passwords, as an anonymous client sends them
        assert users.check_key(f"random-key-{number}") is None
        assert users.check_password("bob", f"wrong-{number}") is None
    hash_runs.clear()
    assert users.check_password("bob", "bob-long-secret").name == "bob"
    assert hash_runs == []  # still remembered: no hash


def test_an_unknown_name_costs_the_hash_a_known_one_does(tmp_path, hash_runs):
    path = tmp_path / "users.txt"
    path.write_text(f"alice:{hash_secret('alice-long-secret', iterations=2000)}\nbob:bob-long-secret\n",
                    encoding="utf-8")
    users = Users.load(path)
    costs = {}
    for name in ("alice", "bob", "nobody"):
        hash_runs.clear()
        assert users.check_password(name, "a-wrong-password") is None
        costs[name] = [iterations for iterations, _ in hash_runs]
    assert costs == {"alice": [2000], "bob": [2000], "nobody": [2000]}
    plain = Users.parse("bob:bob-long-secret\n")  # no hashed secret: no hash for anyone
    hash_runs.clear()
    assert plain.check_password("nobody", "x") is None and plain.check_password("bob", "x") is None
    assert hash_runs == []


def test_repeated_failures_are_refused_for_a_while_with_429(tmp_path, users_path, caplog):
    from heygem.jobs.users import FAILURES_ALLOWED, FailedSignIns

    client, store = rest_client(users_path, outputs=tmp_path / "outputs")
    with caplog.at_level("WARNING", logger="heygem"):
        answers = [client.get("/api/jobs", headers=basic("bob", f"guess-{number}")).status_code
                   for number in range(FAILURES_ALLOWED + 5)]
    assert answers[:FAILURES_ALLOWED] == [401] * FAILURES_ALLOWED and set(answers[FAILURES_ALLOWED:]) == {429}
    refused = client.get("/api/jobs", headers=basic("bob", "bob-long-secret"))  # right, from a refused address
    assert refused.status_code == 429 and 0 < int(refused.headers["Retry-After"]) <= 61
    assert "too many failed sign-ins" in refused.json()["error"]
    assert len([record for record in caplog.records if "sign-in refused" in record.getMessage()]) == 1
    assert client.get("/api/jobs", headers=bearer("random-key")).status_code == 429
    store.close()

    now = [0.0]
    failures = FailedSignIns(allowed=3, window_seconds=60, clock=lambda: now[0])
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):  # one name, tried from many addresses
        assert failures.retry_after(address, "bob") == 0
        failures.failed(address, "bob")
    assert failures.retry_after("10.0.0.4", "bob") == 61 and failures.retry_after("10.0.0.4", "carol") == 0
    now[0] = 61.0
    assert failures.retry_after("10.0.0.4", "bob") == 0


@pytest.fixture()
def app(monkeypatch):
    """app.py, whose main() adds a log handler each time: they are taken away after the test."""
    import logging
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO))
    import app

    logger = logging.getLogger("heygem")
    monkeypatch.setattr(logger, "handlers", list(logger.handlers))
    monkeypatch.setattr(logger, "level", logger.level)
    return app


def test_short_secrets_and_bad_auth_values_end_the_start_with_one_line(tmp_path, capsys, app):
    short = tmp_path / "users.txt"
    short.write_text("alice:alice-long-secret\nbob:bob-secret\n", encoding="utf-8")
    for argv in (["--auth", "anna"], ["--auth", "anna:short"], ["--users", str(short)],
                 ["--users", str(short), "--auth", "anna:a-long-password"]):
        with pytest.raises(SystemExit) as ended:
            app.main(argv)
        assert ended.value.code == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
    assert "shorter than 12 characters" in app_error(app, ["--users", str(short)], capsys)
    assert "shorter than 12 characters" in app_error(app, ["--auth", "anna:short"], capsys)


def app_error(app, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        app.main(argv)
    return capsys.readouterr().err


def test_share_without_users_or_auth_warns_in_one_line(capsys, app):
    with pytest.raises(SystemExit):  # the bad --devices ends it before anything starts
        app.main(["--share", "--devices", "no-such-device"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--share" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "anyone with the public link" in warnings[0]
    with pytest.raises(SystemExit):
        app.main(["--share", "--auth", "anna:a-long-password", "--devices", "no-such-device"])
    assert "public link" not in capsys.readouterr().err


def test_a_user_removed_from_the_file_loses_access_without_a_restart(tmp_path, users_path, monkeypatch):
    import os
    import signal
    import time

    import heygem.jobs.users as users_module

    monkeypatch.setattr(users_module, "LOOK_AT_FILE_SECONDS", 0.0)
    path = tmp_path / "users.txt"
    path.write_text(users_path.read_text(), encoding="utf-8")
    users = Users.load(path)
    client, store = rest_client(users, outputs=tmp_path / "outputs")
    assert client.get("/api/jobs", headers=bearer("bob-long-secret")).status_code == 200
    assert client.get("/api/jobs", headers=basic("bob", "bob-long-secret")).status_code == 200
    path.write_text(users_path.read_text().replace("bob:bob-long-secret\n", ""), encoding="utf-8")
    for headers in (bearer("bob-long-secret"), bearer("bob:bob-long-secret"), basic("bob", "bob-long-secret")):
        assert client.get("/api/jobs", headers=headers).status_code == 401
    assert users.get("bob") is None and sorted(user.name for user in users) == ["alice", "carol"]
    assert client.get("/api/jobs", headers=basic("alice", "alice-long-secret")).status_code == 200

    monkeypatch.setattr(users_module, "LOOK_AT_FILE_SECONDS", 3600.0)  # no looking: SIGHUP reads it
    users.reread()
    path.write_text("dave:dave-long-secret\n", encoding="utf-8")
    assert users.get("dave") is None
    previous = signal.getsignal(signal.SIGHUP)
    try:
        users.reread_on_hangup()
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 30
        while users.get("dave") is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert users.get("dave") is not None and users.get("alice") is None
    path.write_text("not a users line\n", encoding="utf-8")  # a file that no longer reads keeps the users
    assert not users.reread() and users.get("dave") is not None
    store.close()


def test_rest_refuses_requests_from_other_sites_pages(served, speech):
    client, store, _ = served
    files = {"face": ("astronaut.jpg", (ASSETS / "astronaut.jpg").read_bytes()),
             "audio": ("hello.wav", speech.read_bytes())}
    as_bob = basic("bob", "bob-long-secret")
    before = len(store.list())
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "http://localhost:3000"}, {"Origin": "null"},
                    {"Referer": "http://evil.example/page.html"}):
        response = client.post("/api/jobs", files=files, headers={**as_bob, **headers})
        assert response.status_code == 403, (headers, response.text)
        assert "other sites" in response.json()["error"]
    assert client.delete("/api/jobs/x", headers={**as_bob, "Origin": "http://evil.example"}).status_code == 403
    assert client.get("/api/jobs", headers={**as_bob, "Origin": "http://evil.example"}).status_code == 403
    assert len(store.list()) == before
    same_site = client.post("/api/jobs", files=files, headers={**as_bob, "Origin": "http://testserver"})
    assert same_site.status_code == 201, same_site.text
    assert client.post("/api/jobs", files=files, headers=as_bob).status_code == 201  # curl, gradio_client
    assert client.get("/api/jobs", headers={**as_bob, "Referer": "http://elsewhere.example/"}).status_code == 200


# ---------------------------------------------------------------------- the page's server


@pytest.fixture()
def page_server(tmp_path, users_path, monkeypatch):
    """Gradio's server for a page over PageAccess, as app.py launches it (its login and its middleware),
    without a socket; yields (a client, Gradio's app, the access rules, the users file)."""
    import gradio as gr
    from gradio.routes import App
    from starlette.testclient import TestClient

    import heygem.jobs.users as users_module
    from heygem.ui.access import PageAccess

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    monkeypatch.setattr(users_module, "LOOK_AT_FILE_SECONDS", 0.0)
    path = tmp_path / "users.txt"
    path.write_text(users_path.read_text(), encoding="utf-8")
    store = JobStore(tmp_path / "outputs")
    access = PageAccess(store, Users.load(path))
    with gr.Blocks() as demo:
        gr.Markdown("heygem")
    demo.auth, demo.auth_message = access.page_auth(None), "sign in"
    app = App.create_app(demo, app_kwargs={"middleware": [access.middleware()]})
    yield TestClient(app), app, access, path
    store.close()


def signed_in_client(app, name: str, secret: str):
    from starlette.testclient import TestClient

    client = TestClient(app)
    response = client.post("/login", data={"username": name, "password": secret})
    assert response.status_code == 200, response.text
    return client


def test_the_page_login_is_refused_for_a_while_after_repeated_failures(page_server, hash_runs):
    from heygem.jobs.users import FAILURES_ALLOWED

    client, app, _, _ = page_server
    answers = [client.post("/login", data={"username": "carol", "password": f"guess-{number}"})
               for number in range(FAILURES_ALLOWED + 3)]
    assert [answer.status_code for answer in answers[:FAILURES_ALLOWED]] == [400] * FAILURES_ALLOWED
    assert {answer.status_code for answer in answers[FAILURES_ALLOWED:]} == {429}
    assert int(answers[-1].headers["Retry-After"]) > 0
    assert client.post("/login", data={"username": "carol", "password": "carol-long-secret"}).status_code == 429
    assert not any(on_loop for _, on_loop in hash_runs)  # the check runs in a worker thread
    assert app.tokens == {}


def test_the_page_ends_the_sessions_of_users_removed_from_the_file(page_server):
    _, app, _, path = page_server
    bob = signed_in_client(app, "bob", "bob-long-secret")
    signed_in_client(app, "alice", "alice-long-secret")
    assert sorted(app.tokens.values()) == ["alice", "bob"]
    assert bob.get("/gradio_api/login_check").status_code == 200
    path.write_text(path.read_text().replace("bob:bob-long-secret\n", ""), encoding="utf-8")
    assert bob.get("/gradio_api/login_check").status_code == 401
    assert sorted(app.tokens.values()) == ["alice"]
    assert bob.post("/login", data={"username": "bob", "password": "bob-long-secret"}).status_code == 400
    path.write_text(path.read_text().replace("alice:alice-long-secret", "alice:alice-new-secret"), encoding="utf-8")
    assert bob.get("/gradio_api/login_check").status_code == 401 and app.tokens == {}  # a new secret: signed out
    signed_in_client(app, "alice", "alice-new-secret")


def test_a_page_sessions_live_stream_goes_to_its_signed_in_user_only(page_server):
    from types import SimpleNamespace

    from gradio.route_utils import MediaStream
    from starlette.testclient import TestClient

    _, app, access, _ = page_server
    stream = MediaStream()
    stream.segments.append({"id": "first", "extension": ".ts", "duration": 1.0, "data": b"\x47" * 188})
    app.get_blocks().pending_streams.setdefault("bobs-session", {}).setdefault("run-1", {})[7] = stream
    access.note_stream_user(SimpleNamespace(session_hash="bobs-session", username="bob"))
    playlist = "/gradio_api/stream/bobs-session/run-1/7/playlist.m3u8"
    segment = "/gradio_api/stream/bobs-session/run-1/7/first.ts"
    anonymous = TestClient(app)
    assert anonymous.get(playlist).status_code == 401 and anonymous.get(segment).status_code == 401
    carol = signed_in_client(app, "carol", "carol-long-secret")
    assert carol.get(playlist).status_code == 404 and carol.get(segment).status_code == 404
    bob = signed_in_client(app, "bob", "bob-long-secret")
    listed = bob.get(playlist)
    assert listed.status_code == 200 and "first.ts" in listed.text
    assert bob.get(segment).content == b"\x47" * 188


def test_the_page_login_of_auth_checks_in_a_worker_thread_and_counts_failures(tmp_path, monkeypatch):
    import asyncio
    import threading

    from fastapi import HTTPException

    import heygem.ui.access as access_module
    from heygem.jobs.users import FAILURES_ALLOWED
    from heygem.ui.access import PageAccess

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    threads = []
    real = access_module.shared_password_matches
    monkeypatch.setattr(access_module, "shared_password_matches",
                        lambda *args: threads.append(threading.current_thread()) or real(*args))
    store = JobStore(tmp_path / "outputs")
    access = PageAccess(store)  # --auth: one person's server
    assert access.page_auth(None) is None
    check = access.page_auth(("anna", "a-long-password"))

    async def tries():
        loop_thread = threading.current_thread()
        right = await check("anna", "a-long-password")
        wrong = [await check("anna", f"guess-{number}") for number in range(FAILURES_ALLOWED)]
        return loop_thread, right, wrong

    loop_thread, right, wrong = asyncio.run(tries())
    assert right and not any(wrong) and threads and loop_thread not in threads
    with pytest.raises(HTTPException) as refused:
        asyncio.run(check("anna", "a-long-password"))
    assert refused.value.status_code == 429 and int(refused.value.headers["Retry-After"]) > 0
    store.close()
