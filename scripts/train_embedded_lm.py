"""Train the small language model that ``quantlib quantize`` quantizes when no ``--model`` is given.

A transformers ``LlamaForCausalLM`` (hidden 128, 4 layers, byte vocabulary) trained on the CPU on Python
standard-library sources (PSF-licensed), written as a transformers model directory under
``quantlib/embedded/``: ``config.json``, ``model.safetensors`` (bf16), a byte-level tokenizer that loads
offline (``tokenizer.json``, made with ``tokenizers``: token id = byte value), and ``stdlib_sample.txt``,
held-out standard-library modules the pipeline calibrates and evaluates on. Seeded and single-threaded
reductions fixed, so a rerun on the same machine gives the same weights.

    python scripts/train_embedded_lm.py [--steps 800] [--device cuda] [--out quantlib/embedded]
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import quality_models as qm  # noqa: E402

TRAIN_PACKAGES = ("email", "http", "logging", "urllib", "concurrent", "importlib", "xml", "json", "unittest")
#: modules outside the training packages: the shipped calibration / held-out text
HELD_OUT = ("textwrap.py", "string.py", "csv.py", "fractions.py", "heapq.py", "shlex.py", "bisect.py")
EOS = "<|endoftext|>"
VOCAB = 272  # 256 bytes + end of text, padded to a multiple of 16
MAX_POSITIONS = 1024

LICENSE_NOTE = """The text in stdlib_sample.txt is the source of the Python standard library modules {mods}
(CPython {ver}), copyright Python Software Foundation, distributed under the PSF License Agreement
(https://docs.python.org/3/license.html). The model in this directory was trained by
scripts/train_embedded_lm.py on other Python standard-library sources ({pkgs}).
"""


def bytes_to_unicode() -> dict[int, str]:
    """The printable-character alias of each byte that byte-level tokenizers (GPT-2's) use."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(out: str) -> None:
    """A byte-level tokenizer with no merges (id = byte value, EOS = 256) that transformers loads offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab[EOS] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=MAX_POSITIONS)
    fast.save_pretrained(out)
    sample = "def f(x):\n    return x ** 2  # é\n"
    assert fast(sample)["input_ids"] == list(sample.encode()), "token ids must be the bytes"


def stdlib_bytes(names: tuple[str, ...]) -> bytes:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for name in names:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            for dirpath, _, fnames in os.walk(path):
                files += [os.path.join(dirpath, n) for n in fnames if n.endswith(".py")]
        else:
            files.append(path)
    return b"".join(open(f, "rb").read() for f in sorted(files))


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        eos_token_id=256,
        pad_token_id=256,
        bos_token_id=None,
    )
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def held_out_loss(model, text: torch.Tensor, n: int = 32) -> float:
    w = qm.spaced_windows(text, n)
    logits = model(w[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: minutes on a GPU instead of an hour on a laptop CPU")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "quantlib", "embedded"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    train_text = torch.frombuffer(bytearray(stdlib_bytes(TRAIN_PACKAGES)), dtype=torch.uint8).long()
    held = stdlib_bytes(HELD_OUT)
    held_text = torch.frombuffer(bytearray(held), dtype=torch.uint8).long()
    print(f"training bytes {train_text.numel()}, held-out bytes {held_text.numel()}")
    lm = build_model().to(args.device)
    model = qm.LogitsOnly(lm)
    qm.train(model, train_text.to(args.device), args.steps, args.batch, args.lr)  # the quality benchmark's loop (AdamW, cosine)
    held_text = held_text.to(args.device)
    print(f"held-out loss {held_out_loss(model, held_text):.4f} nats/byte")
    lm.to(device="cpu", dtype=torch.bfloat16)
    lm.config.dtype = "bfloat16"
    lm.save_pretrained(args.out)
    write_tokenizer(args.out)
    with open(os.path.join(args.out, "stdlib_sample.txt"), "wb") as f:
        f.write(held)
    import platform

    with open(os.path.join(args.out, "LICENSE.txt"), "w") as f:
        f.write(LICENSE_NOTE.format(mods=", ".join(HELD_OUT), ver=platform.python_version(), pkgs=", ".join(TRAIN_PACKAGES)))


if __name__ == "__main__":
    main()
