"""The weights registry and `python -m heygem weights list|verify|download`, against a local HTTP server."""

from __future__ import annotations

import hashlib
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

import pytest

from heygem import weights
from heygem.cli import main
from heygem.errors import HeygemError

PAYLOAD = bytes(range(256)) * 64 + b"end of the fake checkpoint"  # 16410 bytes
PAYLOAD_SHA256 = hashlib.sha256(PAYLOAD).hexdigest()
PAYLOAD_SIZE = len(PAYLOAD)


class FileServer:
    """http.server in a thread serving ``files`` (path -> bytes) with Range support; records each request."""

    def __init__(self, files: dict[str, bytes], content_type: str = "application/octet-stream"):
        self.files = files
        self.requests: list[dict[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                start = int(match.group(1)) if match else 0
                if start >= len(body) and match:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(body)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206 if match else 200)
                if match:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start:])

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}{path}"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def write_registry(path, *, sha256=PAYLOAD_SHA256, size=PAYLOAD_SIZE, prefix=None):
    """A registry with a fake 'tiny' entry (published size and checksum) and a 'loose' one with neither."""
    def value(item):
        return "null" if item is None else f'"{item}"' if isinstance(item, str) else item

    path.write_text(f"""weights:
  - name: tiny
    files: [tiny.pth, tiny-{PAYLOAD_SHA256[:8]}.pth]
    purpose: engine
    enables: "a test engine"
    size_bytes: {value(size)}
    sha256: {value(sha256)}
    sha256_prefix: {value(prefix)}
    source: https://example.org/tiny
    url: https://example.org/tiny.pth
  - name: loose
    files: [loose.pth]
    purpose: detector
    enables: "a test detector"
    size_bytes: null
    sha256: null
    sha256_prefix: null
    source: https://example.org/loose
    url: null
""")
    return path


@pytest.fixture
def folder(tmp_path, monkeypatch):
    weights_folder = tmp_path / "weights"
    weights_folder.mkdir()
    monkeypatch.setenv("HEYGEM_WEIGHTS", str(weights_folder))
    return weights_folder


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_full_download_writes_the_file_and_no_part(folder, tmp_path, capsys):
    registry = write_registry(tmp_path / "registry.yaml")
    with FileServer({"/tiny.pth": PAYLOAD}) as server:
        code = main(["weights", "--registry", str(registry), "download", "tiny", "--url", server.url("/tiny.pth")])
    assert code == 0
    assert (folder / "tiny.pth").read_bytes() == PAYLOAD
    assert not (folder / "tiny.pth.part").exists()
    assert "range" not in server.requests[0]
    assert "verified" in capsys.readouterr().out


def test_resumed_download_asks_only_for_the_rest(folder, tmp_path):
    entry = weights.load_registry(write_registry(tmp_path / "registry.yaml"))[0]
    half = len(PAYLOAD) // 2
    (folder / "tiny.pth.part").write_bytes(PAYLOAD[:half])
    seen = []
    with FileServer({"/tiny.pth": PAYLOAD}) as server:
        saved = weights.download_weights(entry, folder, server.url("/tiny.pth"),
                                         progress=lambda done, total: seen.append((done, total)))
    assert [request.get("range") for request in server.requests] == [f"bytes={half}-"]
    assert saved.state == weights.VERIFIED and saved.path == folder / "tiny.pth"
    assert saved.path.read_bytes() == PAYLOAD
    assert seen[0][0] > half and seen[-1] == (len(PAYLOAD), len(PAYLOAD))


def test_a_complete_part_file_is_checked_without_a_request(folder, tmp_path):
    entry = weights.load_registry(write_registry(tmp_path / "registry.yaml"))[0]
    (folder / "tiny.pth.part").write_bytes(PAYLOAD)
    with FileServer({"/tiny.pth": PAYLOAD}) as server:
        saved = weights.download_weights(entry, folder, server.url("/tiny.pth"))
    assert server.requests == [] and saved.state == weights.VERIFIED


def test_wrong_checksum_is_refused_and_removed(folder, tmp_path, capsys):
    registry = write_registry(tmp_path / "registry.yaml", sha256="0" * 64)
    with FileServer({"/tiny.pth": PAYLOAD}) as server:
        code = main(["weights", "--registry", str(registry), "download", "tiny", "--url", server.url("/tiny.pth")])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert "tiny.pth" in error and PAYLOAD_SHA256 in error and "removed" in error
    assert list(folder.iterdir()) == []


def test_wrong_sha256_prefix_is_refused(folder, tmp_path):
    entry = weights.load_registry(write_registry(tmp_path / "registry.yaml", sha256=None, size=None,
                                                 prefix="0123abcd"))[0]
    with FileServer({"/tiny.pth": PAYLOAD}) as server, pytest.raises(HeygemError, match="does not start with 0123abcd"):
        weights.download_weights(entry, folder, server.url("/tiny.pth"))
    assert list(folder.iterdir()) == []


def test_right_sha256_prefix_verifies(folder, tmp_path):
    entry = weights.load_registry(write_registry(tmp_path / "registry.yaml", sha256=None, size=None,
                                                 prefix=PAYLOAD_SHA256[:10]))[0]
    with FileServer({"/tiny.pth": PAYLOAD}) as server:
        saved = weights.download_weights(entry, folder, server.url("/tiny.pth"))
    assert saved.state == weights.VERIFIED and "starts with" in saved.detail


def test_a_web_page_instead_of_the_file_is_refused(folder, tmp_path):
    entry = weights.load_registry(write_registry(tmp_path / "registry.yaml", sha256=None, size=None))[0]
    with FileServer({"/share": b"<!doctype html><p>sign in</p>"}, content_type="text/html") as server, \
            pytest.raises(HeygemError, match="web page"):
        weights.download_weights(entry, folder, server.url("/share"))
    assert list(folder.iterdir()) == []


def test_offline_gives_one_line_and_exit_2(folder, tmp_path, capsys):
    registry = write_registry(tmp_path / "registry.yaml")
    url = f"http://127.0.0.1:{closed_port()}/tiny.pth"
    code = main(["weights", "--registry", str(registry), "download", "tiny", "--url", url])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "unreachable" in error and url in error
    assert list(folder.iterdir()) == []


def test_list_and_verify_with_one_good_and_one_corrupt_file(folder, tmp_path, capsys):
    registry = write_registry(tmp_path / "registry.yaml")
    (folder / f"TINY-{PAYLOAD_SHA256[:8]}.pth").write_bytes(PAYLOAD)  # second accepted name, other case
    (folder / "loose.pth").write_bytes(b"whatever the detector file holds")
    main(["weights", "--registry", str(registry), "list"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "verified" in rows["tiny"] and f"TINY-{PAYLOAD_SHA256[:8]}.pth" in rows["tiny"]
    assert "unverified" in rows["loose"] and "a test detector" in rows["loose"]
    assert main(["weights", "--registry", str(registry), "verify"]) == 0
    capsys.readouterr()

    corrupt = bytearray(PAYLOAD)
    corrupt[100] ^= 0xFF  # same size, one byte changed
    (folder / f"TINY-{PAYLOAD_SHA256[:8]}.pth").write_bytes(bytes(corrupt))
    main(["weights", "--registry", str(registry), "list"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "wrong checksum" in rows["tiny"] and "unverified" in rows["loose"]
    main(["weights", "--registry", str(registry), "list", "--quick"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "installed" in rows["tiny"]  # sizes only: the flipped byte is not seen

    assert main(["weights", "--registry", str(registry), "verify"]) == 1
    out = capsys.readouterr().out
    assert "tiny: wrong checksum" in out and hashlib.sha256(bytes(corrupt)).hexdigest() in out
    assert main(["weights", "--registry", str(registry), "verify", "loose"]) == 0
    (folder / "loose.pth").unlink()
    assert main(["weights", "--registry", str(registry), "verify", "loose"]) == 1
    assert "loose: missing" in capsys.readouterr().out


def test_a_short_file_is_a_wrong_size(folder, tmp_path):
    entry = weights.load_registry(write_registry(tmp_path / "registry.yaml"))[0]
    (folder / "tiny.pth").write_bytes(PAYLOAD[:-1])
    state = weights.check_weights(entry, folder, hash_contents=False)
    assert state.state == weights.WRONG_CHECKSUM and f"expected {len(PAYLOAD)}" in state.detail


def test_the_shipped_registry_is_well_formed():
    entries = weights.load_registry()
    by_name = {entry.name: entry for entry in entries}
    musetalk = {name for name in by_name if name.startswith("musetalk_")}
    vibevoice = {name for name in by_name if name.startswith("vibevoice_")}
    assert set(by_name) - musetalk - vibevoice == {"wav2lip", "wav2lip_gan", "gfpgan_v1.4", "s3fd"}
    from heygem.engines.musetalk.files import PARSING_FILES, UNET_FILES, VAE_FILES, WHISPER_FILES

    official = {f"musetalk/{name}" for name in (*UNET_FILES["v15"], *UNET_FILES["v1"], *VAE_FILES, *WHISPER_FILES,
                                                 *PARSING_FILES)}
    assert {by_name[name].files[0] for name in musetalk} == official  # every file of the official layout
    for entry in entries:
        assert entry.purpose in weights.PURPOSES and entry.files and entry.enables
        assert entry.source.startswith("https://") and entry.url.startswith("https://")
        assert entry.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
        assert entry.size_bytes is None or entry.size_bytes > 0
    assert by_name["s3fd"].files == ("s3fd.pth", "s3fd-619a316812.pth")
    assert by_name["s3fd"].sha256 is None and by_name["s3fd"].sha256_prefix == "619a316812"
    # The Wav2Lip loader's file names and the registry's agree.
    assert {by_name["wav2lip"].files[0], by_name["wav2lip_gan"].files[0]} == set(weights.WAV2LIP_FILE_NAMES)


@pytest.mark.parametrize("field, bad, message", [
    ("sha256: null", "sha256: abc123", "64 lowercase hex"),
    ("size_bytes: null", "size_bytes: -5", "positive"),
    ("url: null", "url: http://example.org/x.pth", "https"),
    ("purpose: detector", "purpose: upscaler", "purpose must be one of"),
])
def test_malformed_registry_entries_are_named(tmp_path, field, bad, message):
    registry = write_registry(tmp_path / "registry.yaml")
    text = registry.read_text()
    # the 'loose' entry holds each of these fields with the null/detector value
    head, tail = text.split("- name: loose")
    registry.write_text(head + "- name: loose" + tail.replace(field, bad))
    with pytest.raises(HeygemError, match=message) as error:
        weights.load_registry(registry)
    assert "entry 2" in str(error.value)
