"""heygem.runtime.allocator: frame-sized buffers go back to the kernel once the allocator is tuned."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the allocator is tuned on glibc only")

# In a fresh process: free an 8 MiB buffer (glibc then raises its mapping size to 8 MiB unless it
# is fixed), allocate 6 MiB, say where its middle lies (a mapping of its own or a heap), free it and
# say where that address lies then.
SCRIPT = r"""
import numpy as np
from heygem.runtime import allocator


def mapping_of(address):
    for line in open("/proc/self/maps"):
        fields = line.split()
        start, end = (int(part, 16) for part in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else "anonymous"
    return "unmapped"


outcome = allocator.tune()
first = np.empty(8 * 2**20, np.uint8); first[:] = 1; del first
frame = np.empty(6 * 2**20, np.uint8); frame[:] = 1
address = frame.ctypes.data + 3 * 2**20  # the middle of the buffer
held = mapping_of(address)
del frame
print(outcome, "|", held, mapping_of(address))
"""


def _where_a_frame_lies(**environment) -> tuple[str, str, str]:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("MALLOC_") and name not in ("GLIBC_TUNABLES", "HEYGEM_ALLOCATOR")}
    env.update(environment)
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, env=env,
                            check=False)
    assert result.returncode == 0, result.stderr
    outcome, place = result.stdout.strip().split(" | ")
    held, freed = place.split()
    return outcome, held, freed


def test_tuned_a_frame_sized_buffer_is_given_back_when_freed():
    outcome, held, freed = _where_a_frame_lies(HEYGEM_ALLOCATOR="tuned")
    assert outcome == "tuned"
    assert held == "anonymous"  # a mapping of its own
    assert freed == "unmapped"  # given back to the kernel when freed


def test_left_alone_on_request_where_glibc_moves_frames_into_the_heap():
    outcome, held, freed = _where_a_frame_lies(HEYGEM_ALLOCATOR="system")
    assert outcome == "left: HEYGEM_ALLOCATOR=system"
    # what the tuning prevents: frames in a heap whose freed pages stay with the process
    assert (held, freed) == ("[heap]", "[heap]")
    outcome, _, _ = _where_a_frame_lies(HEYGEM_ALLOCATOR="tuned", MALLOC_ARENA_MAX="2")
    assert outcome == "left: malloc is tuned in the environment"


def test_by_default_tuned_on_machines_of_many_cores_only():
    from heygem.runtime import allocator

    outcome, held, freed = _where_a_frame_lies()
    if (os.cpu_count() or 1) >= allocator.MIN_CORES:
        assert (outcome, held, freed) == ("tuned", "anonymous", "unmapped")
    else:
        assert outcome == f"left: {os.cpu_count()} cores (HEYGEM_ALLOCATOR=tuned tunes it)"
        assert (held, freed) == ("[heap]", "[heap]")
    outcome, _, _ = _where_a_frame_lies(HEYGEM_ALLOCATOR="fast")
    assert outcome == "left: HEYGEM_ALLOCATOR=fast is not auto, tuned or system"


def test_tune_acts_once():
    from heygem.runtime import allocator

    assert allocator.tune() == allocator.tune()
