"""A GGUF target converted once into a plain HF directory, so that later processes skip the GGUF reader.

Loading a .gguf through transformers parses the file's metadata four times per process (the config check, the
tokenizer, the model's config, the weights; SmolLM2's 49k-token vocabulary and merges make each parse ~2.5 s on
the 2-core development machine) and de-quantizes every weight again: ~20 s of every run's wall time, outside any
timer. The first load converts the file instead: what transformers' GGUF loader produces in float32 (the
de-quantized weights, the converted tokenizer, the config and generation config) is saved under the cache
directory ($XPRESS_BENCH_CACHE or ~/.cache/xpress-bench, in hf/), and every later load reads that directory.

Loading the directory at a dtype gives the same tensors, bit for bit, as loading the GGUF at that dtype (the GGUF
loader de-quantizes to float32 and casts; so does this), the same tokenizer and the same config: every conversion
checks what it saved against what the GGUF loader returned before the directory is put in place (`verify`), so the
file each user converts is checked, not only the tests' (tests/test_gguf_cache.py, on a tiny Q4_1 GGUF). The
directory's name is keyed by the file (its resolved path and sha256) and by the versions of transformers, tokenizers,
gguf and torch, so a changed file or library converts again; a directory is renamed into place only when complete.
XPRESS_BENCH_GGUF_CACHE=0 reads the GGUF itself every time, as before. The run's config.json still names the .gguf
file: the directory is only a faster way to read it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ENV = "XPRESS_BENCH_GGUF_CACHE"
FORMAT = 1
STAMP = "xpress_gguf_source.json"  # written last: a directory without it (or with another source) is not used


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def _gguf(spec: str) -> Path | None:
    if not str(spec).lower().endswith(".gguf") or not os.path.isfile(spec):
        return None
    return Path(spec).resolve()


def _version(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


_SHA: dict = {}  # (path, size, mtime_ns, ctime_ns, inode) -> sha256: each file hashed once per process


def _sha256(gguf: Path) -> str:
    st = gguf.stat()
    key = (str(gguf), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _SHA:
        h = hashlib.sha256()
        with open(gguf, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _SHA[key] = h.hexdigest()
    return _SHA[key]


CACHE_ENV = "XPRESS_BENCH_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/xpress-bench")


def default_cache_dir() -> Path:
    """``$XPRESS_BENCH_CACHE`` if set and non-empty, else ``~/.cache/xpress-bench`` (fetched assets and converted
    GGUF directories)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def source(gguf: Path) -> dict:
    """What the converted directory was made from: the file's content (sha256; a file rewritten with the same size
    and mtime is another file) and the library versions; any change makes another directory."""
    return {"format": FORMAT, "gguf": str(gguf), "sha256": _sha256(gguf), "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"), "gguf_reader": _version("gguf"), "torch": _version("torch")}


def directory_for(gguf: Path, src: dict | None = None) -> Path:
    """The converted directory's path for `gguf` (src: its `source`, when the caller has it already)."""
    key = hashlib.sha256(json.dumps(src or source(gguf), sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "hf" / f"{gguf.stem}-{key}"


def cached(spec: str) -> str | None:
    """The converted directory of a .gguf spec when it exists and is complete; None otherwise (nothing is made)."""
    gguf = _gguf(spec) if enabled() else None
    if gguf is None:
        return None
    src = source(gguf)
    d = directory_for(gguf, src)
    try:
        stamp = json.loads((d / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return str(d) if stamp == src else None


def ensure(spec: str) -> str | None:
    """The converted directory of a .gguf spec, converting it now if needed; None when `spec` is no .gguf file,
    the cache is off, or the conversion failed (then the caller reads the GGUF itself, as before)."""
    done = cached(spec)
    gguf = _gguf(spec) if enabled() else None
    if done or gguf is None:
        return done
    try:
        return convert(gguf)
    except Exception as e:  # never worse than reading the GGUF itself
        print(f"[gguf] could not convert {gguf} into the cache ({type(e).__name__}: {e}); reading the GGUF itself",
              file=sys.stderr)
        return None


def _plain(model) -> None:
    """Only de-quantized float weights may be saved: a loader that kept GGUF blocks packed is refused."""
    for name, m in model.named_modules():
        if type(m).__module__.startswith("transformers.integrations.gguf"):
            raise RuntimeError(f"module {name or '<root>'} is {type(m).__name__}: the weights were kept packed")
    for name, t in model.named_parameters():
        if not t.is_floating_point():
            raise RuntimeError(f"{name} is {t.dtype}, not a de-quantized float tensor")


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def save_plain(model, tokenizer, folder) -> None:
    """A model loaded from a GGUF file (its weights already de-quantized) and its tokenizer, saved as a plain HF
    directory. transformers 5.17-5.19: save_pretrained refuses such a model ("quantized with QuantizationMethod.GGUF
    and is not serializable"), so the quantizer's marks are dropped first."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# set by save_pretrained or by the directory's name, read by nothing in the harness
CONFIG_BOOKKEEPING = frozenset({"dtype", "architectures", "_name_or_path", "transformers_version"})
# texts the reloaded tokenizer must encode as the GGUF's does: words, digits, code, spaces, newlines, non-ASCII
PROBES = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
          "def add(a, b):\n    return a + b  # 2 + 3 = 5\n\n", "  leading spaces,\ttabs and trailing  ",
          "Écrivez 3 phrases: naïve café, 東京, emoji 🙂.")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def verify(folder: Path, model, tokenizer) -> None:
    """What `folder` gives a later load against what the GGUF loader returned (`model` in float32, `tokenizer`):
    every saved tensor equal bit for bit, every tensor not saved tied to one that is; the same config less
    bookkeeping; a tokenizer of the same class with the same vocabulary, added tokens, chat template, special ids,
    pipeline (a fast tokenizer's tokenizer.json: merges, pre-tokenizer, decoder) and encodings of PROBES and of the
    chat template's rendering. The tensors are read one at a time from the saved files (no second copy of the
    model). RuntimeError names the first difference."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    def differs(what):
        raise RuntimeError(f"the converted directory differs from the GGUF's load: {what}")
    state = model.state_dict()
    saved = set()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if name not in state:
                    differs(f"{name} is saved but not in the model")
                if t.dtype != state[name].dtype or not torch.equal(t, state[name]):
                    differs(f"tensor {name}")
                saved.add(name)
    ptrs = {state[n].data_ptr() for n in saved}
    for name in state.keys() - saved:
        if state[name].data_ptr() not in ptrs:
            differs(f"tensor {name} is not saved and not tied to a saved one")
    got = AutoConfig.from_pretrained(str(folder)).to_dict()
    want = model.config.to_dict()
    for k in (got.keys() | want.keys()) - CONFIG_BOOKKEEPING:
        if got.get(k) != want.get(k):
            differs(f"config {k}: {got.get(k)!r} against {want.get(k)!r}")
    tok = AutoTokenizer.from_pretrained(str(folder))
    if type(tok) is not type(tokenizer):
        differs(f"tokenizer class {type(tok).__name__} against {type(tokenizer).__name__}")
    checks = {"vocabulary": (tok.get_vocab(), tokenizer.get_vocab()), "chat template": (tok.chat_template,
              tokenizer.chat_template), "added tokens": (tok.added_tokens_decoder, tokenizer.added_tokens_decoder)}
    checks.update({name: (getattr(tok, name), getattr(tokenizer, name)) for name in SPECIAL_IDS})
    if hasattr(tokenizer, "backend_tokenizer"):  # a fast tokenizer: its whole pipeline (vocabulary, merges, ...)
        checks["tokenizer pipeline"] = tuple(getattr(t, "backend_tokenizer", t).to_str() for t in (tok, tokenizer))
    checks.update({f"encoding of {text!r}": (tok.encode(text), tokenizer.encode(text)) for text in PROBES})
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": PROBES[0]}]
        checks["chat rendering"] = tuple(t.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                                         for t in (tok, tokenizer))
    for what, (a, b) in checks.items():
        if a != b:
            differs(what)


def convert(gguf: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = source(gguf)
    final = directory_for(gguf, src)
    final.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _plain(model)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".part"))
    try:
        save_plain(model, tokenizer, tmp)
        verify(tmp, model, tokenizer)
        (tmp / STAMP).write_text(json.dumps(src, indent=2) + "\n")
        _fsync_tree(tmp)
        if final.exists() and cached(str(gguf)) is None:
            shutil.rmtree(final)  # an incomplete or foreign directory under this name
        try:
            os.replace(tmp, final)
        except OSError:
            if cached(str(gguf)) is None:  # another process converted it meanwhile: use theirs, else fail
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"[gguf] converted {gguf.name} once into {final} (later runs load it without the GGUF reader)",
          file=sys.stderr)
    return str(final)


def quantization(spec: str) -> str | None:
    """The quantization a .gguf target was stored in, from its header (`general.file_type`, e.g. "Q4_1" for
    MOSTLY_Q4_1), else the most common tensor type; None for a target that is not a local .gguf file. The run
    de-quantizes it (to float32, then the run dtype): config.json records both."""
    gguf = _gguf(spec)
    if gguf is None:
        return None
    try:
        from gguf import GGUFReader, LlamaFileType
        code = header_file_type(gguf)
        if code is not None:
            return LlamaFileType(code).name.removeprefix("MOSTLY_")
        reader = GGUFReader(str(gguf))
        field = reader.fields.get("general.file_type")
        if field is not None:
            return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_")
        kinds = [t.tensor_type.name for t in reader.tensors]
        return max(set(kinds), key=kinds.count) if kinds else "unknown"
    except Exception as e:  # the header is a label: an unreadable one must not stop the run
        return f"unknown ({type(e).__name__})"


def header_file_type(gguf: Path) -> int | None:
    """`general.file_type` read key by key from a GGUF (version 2 or 3) header, stopping there: GGUFReader parses
    every field first (SmolLM2's 49k-token vocabulary and merges: ~7 s of a run on the 2-core machine, for a label).
    The value types and their widths are gguf's own (GGUFValueType, GGUFReader.gguf_scalar_to_np; gguf 0.19). None
    where the header has no such integer key before its end, or is another version (GGUFReader decides)."""
    import struct

    import numpy as np
    from gguf import GGUFReader, GGUFValueType
    scalars = {int(k): np.dtype(v).newbyteorder("<") for k, v in GGUFReader.gguf_scalar_to_np.items()}
    with open(gguf, "rb") as f:
        def read(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind, count=1):
            if kind == GGUFValueType.STRING:  # strings: each its own length
                for _ in range(count):
                    f.seek(read("<Q"), 1)
            elif kind == GGUFValueType.ARRAY:  # arrays: each its own item type and count, then its items
                for _ in range(count):
                    item = read("<I")
                    skip(item, read("<Q"))
            else:
                f.seek(scalars[kind].itemsize * count, 1)  # (KeyError: a type this reader does not know)
        try:
            if f.read(4) != b"GGUF" or read("<I") not in (2, 3):
                return None
            _tensors, n_kv = read("<Q"), read("<Q")
            for _ in range(n_kv):
                key = f.read(read("<Q"))
                kind = read("<I")
                if key == b"general.file_type" and kind in scalars and scalars[kind].kind in "iu":
                    return int(np.frombuffer(f.read(scalars[kind].itemsize), scalars[kind])[0])
                skip(kind)
        except (KeyError, struct.error):
            return None
    return None
