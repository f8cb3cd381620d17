"""The engine registry and interface, and the registry of what a worker keeps between jobs."""

from __future__ import annotations

import os
import threading

import pytest

from heygem.config import EngineConfig, iter_options
from heygem.engines import ENGINES, choose_engine
from heygem.engines.base import EngineKind
from heygem.errors import HeygemError
from heygem.runtime.kept import Kept, KeptKind, file_identity


def test_every_engine_is_a_choice_of_the_engine_option_and_auto_tries_them_in_order(no_weights):
    choices = next(leaf.metadata["choices"] for section, leaf in iter_options()
                   if (section, leaf.name) == ("engine", "name"))
    assert choices == ("auto", *ENGINES)
    assert all(isinstance(kind, EngineKind) and kind.name == name for name, kind in ENGINES.items())
    assert list(ENGINES)[-1] == "landmark" and not ENGINES["landmark"].needs_weights  # the last resort
    choice = choose_engine(EngineConfig(name="auto"))
    assert choice.name == "landmark" and choice.weights is None
    assert choice.reason == (f"auto: no complete MuseTalk files (with the musetalk extra installed) or Wav2Lip "
                             f"checkpoint in {no_weights}, using the built-in engine")


def test_auto_picks_wav2lip_when_its_file_is_there_and_an_explicit_engine_needs_its_weights(no_weights):
    with pytest.raises(HeygemError, match="--engine wav2lip needs a checkpoint: put wav2lip_gan.pth or wav2lip.pth"):
        choose_engine(EngineConfig(name="wav2lip"))
    with pytest.raises(HeygemError, match="checkpoint not found"):
        choose_engine(EngineConfig(name="auto", checkpoint=str(no_weights / "missing.pth")))
    (no_weights / "Wav2Lip_GAN.pth").write_bytes(b"not read while choosing")
    choice = choose_engine(EngineConfig(name="auto"))
    assert (choice.name, choice.weights.name, choice.reason) == ("wav2lip", "Wav2Lip_GAN.pth",
                                                                 "auto: found Wav2Lip_GAN.pth")
    assert ENGINES["wav2lip"].synthesises_pixels and not ENGINES["landmark"].synthesises_pixels


def test_choosing_an_engine_imports_no_network_library():
    import subprocess
    import sys

    code = ("import sys; from heygem.config import EngineConfig; from heygem.engines import choose_engine; "
            "choose_engine(EngineConfig()); "
            "print(sorted(m for m in ('torch', 'mediapipe', 'gradio') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


class Thing:
    def __init__(self, name: str):
        self.name, self.closed, self.running = name, False, True

    def close(self) -> None:
        self.closed = True

    def alive(self) -> bool:
        return self.running


def test_shared_things_are_built_once_per_key_and_per_owner_kinds_keep_one_per_thread():
    kept = Kept()
    network = KeptKind("network", most=2)
    built = []

    def build(name):
        built.append(name)
        return Thing(name)

    first = kept.shared(network, ("a",), lambda: build("a"))
    assert kept.shared(network, ("a",), lambda: build("again")) is first and built == ["a"]
    kept.shared(network, ("b",), lambda: build("b"))
    kept.shared(network, ("c",), lambda: build("c"))  # at most two: the oldest goes, closed
    assert first.closed and [thing.name for thing in kept.kept(network)] == ["b", "c"]

    engine = KeptKind("engine", most=4, per_owner=True)
    mine = kept.shared(engine, ("x",), lambda: Thing("mine"), owner=1)
    theirs = kept.shared(engine, ("x",), lambda: Thing("theirs"), owner=2)
    assert mine is not theirs and kept.shared(engine, ("x",), lambda: Thing("no"), owner=1) is mine
    newer = kept.shared(engine, ("y",), lambda: Thing("newer"), owner=1)  # other options: one per owner
    assert mine.closed and kept.kept(engine) == [theirs, newer]
    kept.release(1)
    assert newer.closed and not theirs.closed and kept.kept(engine) == [theirs]
    assert kept.kept(network) != [] and not any(thing.closed for thing in kept.kept(network))  # shared: not released
    kept.release()
    assert kept.kept(engine) == kept.kept(network) == [] and theirs.closed


def test_handed_back_things_are_taken_out_and_a_stale_or_dead_one_is_closed():
    kept = Kept()
    pools = KeptKind("pools", most=1, process_wide=True)
    pool = Thing("pool")
    kept.put(pools, ("two",), pool)
    assert kept.take(pools, ("two",)) is pool and kept.kept(pools) == []  # out while a job uses it
    assert kept.take(pools, ("two",)) is None
    kept.put(pools, ("two",), pool)
    assert kept.take(pools, ("three",)) is None and pool.closed  # built with other options: stopped
    dead = Thing("dead")
    dead.running = False
    kept.put(pools, ("two",), dead)
    assert kept.take(pools, ("two",), usable=lambda thing: thing.alive()) is None and dead.closed
    kept.put(pools, ("two",), Thing("again"))
    kept.release(owner=12345)  # any worker's release stops the process-wide pool
    assert kept.kept(pools) == []


def test_a_thing_built_from_a_file_that_changed_is_dropped(tmp_path):
    kept = Kept()
    network = KeptKind("network", most=4)
    checkpoint = tmp_path / "weights.pth"
    checkpoint.write_bytes(b"one")
    old = kept.shared(network, (file_identity(checkpoint), "cpu"), lambda: Thing("old"))
    other_device = kept.shared(network, (file_identity(checkpoint), "cuda:0"), lambda: Thing("other device"))
    checkpoint.write_bytes(b"two!")
    os.utime(checkpoint, ns=(1, 1))
    new = kept.shared(network, (file_identity(checkpoint), "cpu"), lambda: Thing("new"))
    assert new is not old and old.closed and other_device.closed  # whatever was built from the old file
    assert kept.kept(network) == [new]


def test_the_same_shared_thing_is_not_built_twice_at_once():
    kept = Kept()
    network = KeptKind("network", most=2)
    started, release, built = threading.Event(), threading.Event(), []

    def slow_build():
        built.append(1)
        started.set()
        release.wait(5)
        return Thing("slow")

    results = []
    threads = [threading.Thread(target=lambda: results.append(kept.shared(network, ("k",), slow_build)))
               for _ in range(2)]
    threads[0].start()
    started.wait(5)
    threads[1].start()
    release.set()
    for thread in threads:
        thread.join(5)
    assert len(built) == 1 and results[0] is results[1]
