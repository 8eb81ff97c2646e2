"""Makes a Megatron-Core commit importable and initialises its process group (one rank, or a
rank of a multi-rank run).

Where Megatron-Core comes from, first match wins:
  1. $MCORE_SRC: a directory holding `megatron/core/`, or a shared directory with the tarball
     `megatron-core-<commit>.tar.xz` (and `mcore_shims.py`);
  2. $MCORE_COMMIT: one of KNOWN_COMMITS (a prefix of its hash will do), found in its folder
     beside the source tree (`../shared/megatron-core` for the January pin,
     `../shared/megatron-core-d98e8a64` for the current commit);
  3. `../shared/megatron-core` beside the mcore-twin source tree: the January pin.
A tarball is unpacked once into $XDG_CACHE_HOME/mcore_twin (default ~/.cache/mcore_twin), keyed
by its name and size. The shims that make a commit run on Debian's CPU-only torch 1.13 are
imported before Megatron: `mcore_shims.py` where it sits beside the tarball or the source (the
January pin's), else the project's own for that commit (`shims_<commit>.py`, only on a torch
older than 2: a newer torch runs Megatron as it is). The project's multi-latent attention shims
follow them where needed (mla.apply_shims: YaRN on a torch older than 2, Transformer Engine absent).
"""

import glob
import os
import socket
import sys
import tarfile
import tempfile

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MegatronNotFound(RuntimeError):
    pass


# The Megatron-Core commits this project knows: short hash -> (full hash, its folder beside the
# source tree). The first is the January pin, the default.
KNOWN_COMMITS = {
    "93ddc247": ("93ddc24720bb8d62ae68ced044ad59e1a95ead0f", "megatron-core"),
    "d98e8a64": ("d98e8a64ddf34856e74b24714e3bedb2f5a39553", "megatron-core-d98e8a64"),
}
PINNED_COMMIT = KNOWN_COMMITS["93ddc247"][0]


def known_commit(name):
    """The short hash of KNOWN_COMMITS that `name` (the hash, or a prefix of 7 digits or more)
    names, or MegatronNotFound naming the known ones."""
    name = (name or "").strip().lower()
    for short, (full, _) in KNOWN_COMMITS.items():
        if len(name) >= 7 and full.startswith(name):
            return short
    raise MegatronNotFound(f"unknown Megatron-Core commit {name!r}: known are {', '.join(KNOWN_COMMITS)}")


def full_commit(commit):
    """The full hash of a known commit given by a prefix; other names are returned as they are."""
    try:
        return KNOWN_COMMITS[known_commit(commit)][0]
    except MegatronNotFound:
        return commit


def default_location():
    """The Megatron-Core location this process would use, or None (with the reason in the error)."""
    env = os.environ.get("MCORE_SRC")
    if env:
        return env
    folder = KNOWN_COMMITS[known_commit(os.environ.get("MCORE_COMMIT") or "93ddc247")][1]
    shared = os.path.normpath(os.path.join(SOURCE_ROOT, "..", "shared", folder))
    return shared if os.path.isdir(shared) else None


def find_megatron():
    """(directory holding megatron/core, directory of mcore_shims.py or None, commit or None)."""
    loc = default_location()
    if loc is None:
        folder = KNOWN_COMMITS[known_commit(os.environ.get("MCORE_COMMIT") or "93ddc247")][1]
        raise MegatronNotFound(
            f"Megatron-Core not found: set MCORE_SRC, or provide ../shared/{folder} beside the source tree "
            f"({os.path.normpath(os.path.join(SOURCE_ROOT, '..', 'shared', folder))})"
        )
    if not os.path.isdir(loc):
        raise MegatronNotFound(f"MCORE_SRC={loc} is not a directory")
    shims = loc if os.path.isfile(os.path.join(loc, "mcore_shims.py")) else None
    if os.path.isdir(os.path.join(loc, "megatron", "core")):
        return loc, shims, None
    tarballs = sorted(glob.glob(os.path.join(loc, "megatron-core-*.tar.xz")))
    if not tarballs:
        raise MegatronNotFound(f"{loc} holds neither megatron/core nor a megatron-core-*.tar.xz")
    tarball = tarballs[-1]
    commit = full_commit(os.path.basename(tarball)[len("megatron-core-") : -len(".tar.xz")])
    return unpack(tarball), shims, commit


def _project_shims(commit):
    """The project's shims module for `commit` on this torch, or None: they exist for commits
    without shims of their own, and only a torch older than 2 needs them."""
    import importlib

    import torch

    if not commit or int(torch.__version__.split(".")[0]) >= 2:
        return None
    try:
        short = known_commit(commit)
    except MegatronNotFound:
        return None
    try:
        return importlib.import_module(f"{__package__}.shims_{short}")
    except ModuleNotFoundError:
        return None


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mcore_twin")


def unpack(tarball):
    """Unpacks `tarball` once; later calls (and other processes) reuse the directory."""
    name = os.path.basename(tarball)[: -len(".tar.xz")]
    dest = os.path.join(cache_dir(), f"{name}-{os.path.getsize(tarball)}")
    if os.path.isdir(os.path.join(dest, "megatron", "core")):
        return dest
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=name + ".", dir=cache_dir())
    with tarfile.open(tarball, "r:xz") as tf:
        for member in tf.getmembers():  # a tarball is outside bytes: nothing may land outside tmp
            target = os.path.realpath(os.path.join(tmp, member.name))
            if not target.startswith(os.path.realpath(tmp) + os.sep) or member.issym() or member.islnk():
                raise MegatronNotFound(f"{tarball}: refusing member {member.name!r}")
        tf.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    try:
        os.rename(tmp, dest)  # atomic: a concurrent unpacker loses the race and keeps its copy out
    except OSError:
        if not os.path.isdir(os.path.join(dest, "megatron", "core")):
            raise
    return dest


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STATE = {}


def bootstrap(*, rank=0, world_size=1, tensor_parallel=1, expert_parallel=1, master_port=None):
    """Imports Megatron-Core (pinned copy, shims first) and initialises torch.distributed (gloo) and
    Megatron's parallel state, once per process: world size 1 by default; a rank of a multi-rank
    run (parallel.py) gives its rank, the world size, the tensor- and expert-parallel sizes and the
    port every rank uses, and gets gloo_shims. Returns a dict with `src`, `commit`, `shims` (the patches
    applied)."""
    if _STATE:
        layout = (world_size, tensor_parallel, expert_parallel)
        if _STATE["layout"] != layout:
            raise RuntimeError(
                f"this process is set up for (world, tensor parallel, expert parallel) {_STATE['layout']}, not "
                f"{layout}: one layout per process"
            )
        return _STATE
    src, shims_dir, commit = find_megatron()
    for p in (src, shims_dir):
        if p and p not in sys.path:
            sys.path.insert(0, p)
    applied = []
    mcore_shims = None
    if shims_dir:
        import mcore_shims  # noqa: F401  (before any megatron module)
    else:
        mcore_shims = _project_shims(commit)
    if mcore_shims is not None:
        applied = mcore_shims.PATCHES
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(master_port or _free_port())
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_parallel, 1, expert_model_parallel_size=expert_parallel)
    if mcore_shims is not None:
        mcore_shims.post_import_patches()
    from . import mla

    applied = list(applied) + mla.apply_shims()  # multi-latent attention on this CPU (mla.py)
    if world_size > 1:
        from . import gloo_shims

        applied = list(applied) + gloo_shims.apply()
    from megatron.core.tensor_parallel import random as mrandom

    # No CUDA RNG on the CPU: the inference tracker draws from torch's CPU generator.
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _STATE.update(src=src, commit=commit, shims=list(applied), layout=(world_size, tensor_parallel, expert_parallel))
    return _STATE

