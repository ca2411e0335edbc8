"""The Qwen2/Qwen3 tokenizer, rebuilt reproducibly from Qwen's own BPE ranks (the Hugging Face Hub is
not reachable here), for bench/grammar_backends.py's second vocabulary.

``ensure_qwen_tokenizer()`` downloads the wheel ``dashscope==2.0.2`` from PyPI as a file
(``pip download --no-deps``; nothing is installed), takes ``dashscope/resources/qwen.tiktoken`` out of
it (Qwen's BPE ranks file, 151,643 tokens, sha256 pinned below; a local copy can be given instead),
and converts it into a Hugging Face ``tokenizer.json`` by the standard tiktoken -> HF conversion
(Qwen2's own vocab.json / merges.txt are that conversion of the same ranks): byte-level BPE, vocab =
the ranks with bytes mapped through GPT-2's bytes_to_unicode, one merge per non-byte token (the pair
the BPE of its bytes ends in, in rank order; 151,387 merges), Qwen's pre-tokenizer regex + NFC
normalizer, and the 26 Qwen3 added tokens (ids 151643..151668: <|endoftext|>, <|im_start|>,
<|im_end|>, ..., <think>, </think>) with their special flags; model vocab 151,936. The result is
checked against token ids published for Qwen2/3 ("<|im_start|>system\\nYou are a helpful
assistant.<|im_end|>\\n" and "Hello, my name is") and cached in a directory (default
~/.cache/pdserve/qwen-tokenizer, mode 0700) holding tokenizer.json, tokenizer_config.json and
SOURCE.json (where it came from, the sha256, the builder version).

    python bench/qwen_tokenizer.py                                  # build into the default directory
    python bench/qwen_tokenizer.py --out /tmp/qwen --tiktoken qwen.tiktoken
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

DEFAULT_DIR = "~/.cache/pdserve/qwen-tokenizer"
QWEN_WHEEL = "dashscope==2.0.2"
QWEN_MEMBER = "dashscope/resources/qwen.tiktoken"
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
QWEN_N_RANKS = 151_643
QWEN_MODEL_VOCAB = 151_936     # Qwen3's embedding rows (padded past the 151,669 tokenizer ids)
QWEN_BUILDER_VERSION = 1
# Qwen's pre-tokenizer (identical in qwen_tokenizer.py of Qwen-1 and Qwen2's tokenizer.json)
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen3's added tokens from id 151643 on, with their "special" flag (tokenizer.json / tokenizer_config)
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
# token ids published for Qwen2/2.5/3 tokenizers (chat-template system turn; vLLM/HF examples)
QWEN_KNOWN_IDS = {
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n":
        [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198],
    "Hello, my name is": [9707, 11, 847, 829, 374],
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """The parts of ``token`` after byte-level BPE with only merges ranked below ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while True:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best_rank is None or best_rank >= max_rank:
            return parts
        parts[best:best + 2] = [parts[best] + parts[best + 1]]


def qwen_tokenizer_json(tiktoken_text: bytes) -> str:
    """A Hugging Face tokenizer.json (Qwen3) made from the contents of qwen.tiktoken."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    ranks: dict[bytes, int] = {}
    for line in tiktoken_text.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if len(ranks) != QWEN_N_RANKS or sorted(ranks.values()) != list(range(QWEN_N_RANKS)):
        raise RuntimeError(f"qwen.tiktoken: {len(ranks)} ranks, expected 0..{QWEN_N_RANKS - 1}")
    b2u = _bytes_to_unicode()
    to_str = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = _bpe_split(ranks, tok, rank)
        if len(parts) != 2:
            raise RuntimeError(f"token {tok!r} (rank {rank}) is not one merge of two lower ranks")
        merges.append((to_str(parts[0]), to_str(parts[1])))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, fuse_unk=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    for text, special in QWEN3_ADDED:   # one at a time: ids 151643, 151644, ... in this order
        added = AddedToken(text, special=special, normalized=False)
        tk.add_special_tokens([added]) if special else tk.add_tokens([added])
    for i, (text, _) in enumerate(QWEN3_ADDED):
        if tk.token_to_id(text) != QWEN_N_RANKS + i:
            raise RuntimeError(f"{text} got id {tk.token_to_id(text)}, expected {QWEN_N_RANKS + i}")
    for text, ids in QWEN_KNOWN_IDS.items():
        got = tk.encode(text, add_special_tokens=False).ids
        if got != ids:
            raise RuntimeError(f"built Qwen tokenizer encodes {text!r} as {got}, Qwen's is {ids}")
    return tk.to_str()


QWEN_TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast", "backend": "tokenizers",
    "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
    "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
    "errors": "replace", "model_max_length": 131072, "split_special_tokens": False,
}


def ensure_qwen_tokenizer(directory: Path, tiktoken_file: Path | None = None,
                          say: Callable[[str], None] = print) -> Path:
    """``directory`` holding Qwen3's tokenizer (tokenizer.json, tokenizer_config.json, SOURCE.json),
    built on first use from qwen.tiktoken: ``tiktoken_file`` if given, else the member of the
    dashscope wheel downloaded from PyPI (``pip download --no-deps``: no install, no dependencies)."""
    directory = directory.expanduser()
    source = directory / "SOURCE.json"
    if (directory / "tokenizer.json").is_file() and source.is_file():
        try:
            if json.loads(source.read_text()).get("builder_version") == QWEN_BUILDER_VERSION:
                return directory
        except ValueError:
            pass
    directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(prefix="qwen-tok-") as tmp:
        if tiktoken_file is None:
            say(f"fetching Qwen's qwen.tiktoken from the PyPI wheel {QWEN_WHEEL} (pip download --no-deps)")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
                   "--disable-pip-version-check", "-q", "-d", tmp, QWEN_WHEEL]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or len(wheels) != 1:
                raise SystemExit(f"could not download {QWEN_WHEEL}: {done.stderr.strip()[-300:]}; pass "
                                 f"a local qwen.tiktoken (sha256 {QWEN_TIKTOKEN_SHA256[:16]}...): "
                                 f"grammar_backends.py --qwen-tiktoken / qwen_tokenizer.py --tiktoken")
            with zipfile.ZipFile(wheels[0]) as zf:
                data = zf.read(QWEN_MEMBER)
            origin = f"{wheels[0].name}:{QWEN_MEMBER}"
        else:
            data, origin = tiktoken_file.read_bytes(), str(tiktoken_file)
        digest = hashlib.sha256(data).hexdigest()
        if digest != QWEN_TIKTOKEN_SHA256:
            raise SystemExit(f"{origin}: sha256 {digest[:16]}..., expected {QWEN_TIKTOKEN_SHA256[:16]}... (pinned)")
        say("converting qwen.tiktoken into a Hugging Face tokenizer.json (Qwen3 specials)")
        build = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            (build / "tokenizer.json").write_text(qwen_tokenizer_json(data), encoding="utf-8")
            (build / "tokenizer_config.json").write_text(json.dumps(QWEN_TOKENIZER_CONFIG, indent=1))
            (build / "SOURCE.json").write_text(json.dumps({
                "builder_version": QWEN_BUILDER_VERSION, "from": origin, "wheel": QWEN_WHEEL,
                "qwen_tiktoken_sha256": digest, "model_vocab_size": QWEN_MODEL_VOCAB,
                "how": "bench/qwen_tokenizer.py ensure_qwen_tokenizer()"}, indent=1))
            build.chmod(0o700)
            if directory.exists():
                shutil.rmtree(directory)
            os.rename(build, directory)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    return directory



def hf_tokenizer(directory: Path) -> Any:
    """The built tokenizer as a transformers tokenizer (EOS <|im_end|>, pad <|endoftext|>)."""
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_DIR, help=f"directory to build the tokenizer into (default {DEFAULT_DIR})")
    p.add_argument("--tiktoken", default=None, help="a local qwen.tiktoken instead of downloading the wheel")
    p.add_argument("--rebuild", action="store_true", help="build again even if the directory holds a current build")
    args = p.parse_args(argv)
    say = lambda s: print(f"# {s}", file=sys.stderr, flush=True)  # noqa: E731
    out = Path(args.out).expanduser()
    if args.rebuild and (out / "SOURCE.json").is_file():
        (out / "SOURCE.json").unlink()
    directory = ensure_qwen_tokenizer(out, Path(args.tiktoken) if args.tiktoken else None, say)
    source = json.loads((directory / "SOURCE.json").read_text())
    print(json.dumps({"directory": str(directory), **source}, indent=1))


if __name__ == "__main__":
    main()
