"""Merging dynamic-shape profiles (torch's ``pgo`` artifacts) the way torch merges them.

A profile is one pickled ``dict[CodeId, CodeState]`` per job id (``TORCH_COMPILE_JOB_ID``), and every
process of a job writes the same key. xdist workers each grow their own copy with the frames they ran:
keeping one copy loses the other workers' frames, and those functions compile static, miss and recompile
in every later run. So the controller merges the copies with torch's own rule (``FrameStateSizeEntry``'s
``|=``: a dimension seen with two sizes becomes dynamic).

Unpickling a profile needs torch's classes, and the controller never imports torch (it runs no tests):
the merge runs in a short-lived ``python -c`` child of the same interpreter, with a timeout. It is
needed only when copies differ, which is in the run that compiled something new. The profiles come from
the restored (validated) bundle and from this session's own workers.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from ..errors import MegacacheError, redact_cut

MERGE_TIMEOUT = 60.0  # at least this long: the child imports torch

# stdin: frames of <8-byte big-endian length><bytes>; the first frame is the base (empty: none).
# stdout: b"S" when the merge equals the base, else b"M" + the merged pickle.
_CHILD = r"""
import copy, pickle, struct, sys
from collections import defaultdict
from torch._dynamo import pgo

data, blobs, at = sys.stdin.buffer.read(), [], 0
while at < len(data):
    (n,) = struct.unpack_from(">Q", data, at)
    blobs.append(data[at + 8:at + 8 + n])
    at += 8 + n
base = pickle.loads(blobs[0]) if blobs[0] else None
merged = defaultdict(pgo.CodeState)
for blob in [b for b in blobs if b]:
    for code_id, state in pickle.loads(blob).items():
        into = merged[code_id].automatic_dynamic
        for source, entry in state.automatic_dynamic.items():
            if source in into and hasattr(into[source], "__ior__"):
                into[source] |= entry
            else:
                into[source] = copy.deepcopy(entry)
if base is not None and merged == base:
    sys.stdout.buffer.write(b"S")
else:
    sys.stdout.buffer.write(b"M" + pickle.dumps(merged))
"""


class ProfileMergeError(MegacacheError):
    """The profiles could not be merged (no torch, a timeout, a profile torch cannot read)."""


def frame(blobs: Sequence[bytes]) -> bytes:
    return b"".join(struct.pack(">Q", len(b)) + b for b in blobs)


def merge_profiles(base: bytes | None, copies: Sequence[bytes], timeout: float = MERGE_TIMEOUT,
                   python: str = sys.executable) -> bytes | None:
    """The union of ``base`` and ``copies`` as torch merges profiles; None when it says nothing ``base``
    does not (so there is nothing to upload). Raises ProfileMergeError."""
    # Importing torch creates its cache directories: the child's go to a scratch folder, not the session's.
    with tempfile.TemporaryDirectory(prefix="megacache-pgo-") as scratch:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(scratch, "triton")}
        try:
            proc = subprocess.run([python, "-c", _CHILD], input=frame([base or b"", *copies]), capture_output=True,
                                  timeout=timeout, check=False, env=env, cwd=scratch)
        except subprocess.TimeoutExpired as exc:
            raise ProfileMergeError(f"merging took over {timeout:g} s") from exc
        except OSError as exc:
            raise ProfileMergeError(f"could not start {python}: {exc}") from exc
    out = proc.stdout
    if proc.returncode != 0 or not out or out[:1] not in (b"S", b"M"):
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise ProfileMergeError(redact_cut(tail[0]))
    return None if out[:1] == b"S" else out[1:]
