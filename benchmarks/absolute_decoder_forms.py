"""Which form for a decoder with absolute positions: the CP form or the shared-key form, at equal key cache?

    python benchmarks/absolute_decoder_forms.py [--budgets 0.5,0.25] [--train-steps 1500] [--evaluate 64]

No GPT-2 or OPT weights ship on PyPI, so the script first trains a small GPT-2 on Brown (three quarters of
its texts; 4 layers, D = 128, 4 heads, 128 positions, a 4,096-piece WordPiece vocabulary cut from MiniLM's;
kept in data/ and reused), long enough that its heads attend to something. Then, through the CLI as a user
runs it, at each key-cache budget B (share of the original's key numbers per token):
  - shared-key form: `compress --form shared-key --key-cache B`,
  - CP form: `compress --form collaborative --rank R` with R + N_h = B * D (its cache holds the shared key and
    one content-bias number per head: equal cache),
each weight-only and calibrated (`--calibration`, 256 Brown documents, default refinement). Printed side by side:
perplexity on held-out Brown documents (texts disjoint from training and calibration), the next-token KL to the
original, cached key numbers per token and layer, and query/key parameters; and, for scale, the same for the
model with uniform attention (every query zeroed): what its attention scores are worth at all.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from calibration_documents import documents  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCABULARY = 4096
LENGTH = 128


def tokenizer_for(texts: list[str]):
    """MiniLM's WordPiece, cut to the specials, every single character and the most frequent pieces on `texts`."""
    from transformers import AutoTokenizer, BertTokenizerFast

    from collab_convert.io.folders import DEFAULT_MODEL, resolve_model

    full = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    counts = Counter(piece for text in texts for piece in full.tokenize(text))
    keep = list(full.all_special_tokens)
    keep += [p for p in full.get_vocab() if len(p.removeprefix("##")) == 1 and p not in keep]
    keep += [p for p, _ in counts.most_common() if p not in set(keep)][: VOCABULARY - len(keep)]
    return BertTokenizerFast(vocab={piece: i for i, piece in enumerate(keep)}, do_lower_case=True)


def trained_model(folder: Path, texts: list[str], steps: int):
    """A small GPT-2 trained on `texts` (cached in `folder`)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if (folder / "config.json").exists():
        return
    torch.manual_seed(0)
    tokenizer = tokenizer_for(texts)
    ids = torch.tensor([i for text in texts for i in tokenizer(text)["input_ids"][1:-1]])  # one token stream
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=128, n_layer=4, n_head=4, n_positions=LENGTH,
                        bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config).train()
    optimiser = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=2e-3, total_steps=steps, pct_start=0.05)
    started = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - LENGTH, (16,))
        batch = torch.stack([ids[s:s + LENGTH] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"  training step {step}: loss {float(loss.detach()):.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@torch.no_grad()
def next_token_log_probabilities(folder: Path, texts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids, log-probabilities of each next token) per text."""
    import collab_convert  # noqa: F401 - registers the loader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    found = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=LENGTH,
                        add_special_tokens=False)["input_ids"]
        found.append((ids[0], torch.log_softmax(model(ids).logits[0, :-1].float(), -1)))
    return found


def perplexity_and_kl(found, reference=None) -> tuple[float, float]:
    """Perplexity on the texts, and the mean next-token KL(reference || found) in nats per token."""
    loss = sum(float(-lp.gather(1, ids[1:, None]).sum()) for ids, lp in found)
    tokens = sum(len(ids) - 1 for ids, _ in found)
    if reference is None:
        return math.exp(loss / tokens), 0.0
    kl = sum(float((ref.exp() * (ref - lp)).sum()) for (_, ref), (_, lp) in zip(reference, found, strict=True))
    return math.exp(loss / tokens), kl / tokens


def uniform_attention(model: Path, out: Path) -> None:
    """The model with every query zeroed: each head attends uniformly to the tokens before it. What the
    attention scores are worth in this model: the loss of a compression is read against this one."""
    from transformers import AutoModelForCausalLM

    copy = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for block in copy.transformer.h:
            block.attn.c_attn.weight[:, : copy.config.n_embd] = 0  # Conv1D: (in, [q | k | v])
            block.attn.c_attn.bias[: copy.config.n_embd] = 0
    copy.save_pretrained(out)
    for name in model.iterdir():
        if name.name.startswith(("tokenizer", "vocab", "special")):
            (out / name.name).write_bytes(name.read_bytes())


def compress(model: Path, out: Path, *flags: str) -> tuple[dict, float]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "collab_convert", "compress", str(model), "-o", str(out), "--json",
                    "--no-plots", *flags], check=True, capture_output=True, text=True)
    return json.loads((out / "report.json").read_text()), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.5,0.25,0.125")
    parser.add_argument("--train-steps", type=int, default=1500)
    parser.add_argument("--calibration", type=int, default=256)
    parser.add_argument("--evaluate", type=int, default=64)
    args = parser.parse_args()
    calibration, held_out = documents()
    model = ROOT / "data" / f"tiny-gpt2-brown-{args.train_steps}"
    print(f"Training a small GPT-2 on {len(calibration)} Brown documents ({args.train_steps} steps), or reusing it")
    trained_model(model, calibration, args.train_steps)
    evaluate = held_out[: args.evaluate]
    config = json.loads((model / "config.json").read_text())
    width, heads = config["n_embd"], config["n_head"]
    reference = next_token_log_probabilities(model, evaluate)
    print(f"Original: perplexity {perplexity_and_kl(reference)[0]:.2f} on {len(evaluate)} held-out documents; "
          f"{width} key numbers per token and layer")
    with tempfile.TemporaryDirectory() as scratch:
        uniform_attention(model, Path(scratch) / "uniform")
        ppl, kl = perplexity_and_kl(next_token_log_probabilities(Path(scratch) / "uniform", evaluate), reference)
        print(f"Uniform attention (every query zeroed): perplexity {ppl:.2f}, KL to the original {kl:.2e} nats/token")
        text = Path(scratch) / "calibration.txt"
        text.write_text("\n".join(calibration[: args.calibration]) + "\n")
        print("| budget | form | fit | perplexity | KL to the original | key numbers / token / layer | Q/K params "
              "| seconds |")
        print("|---:|---|---|---:|---:|---:|---:|---:|")
        for budget in (float(b) for b in args.budgets.split(",")):
            forms = {"shared-key": ["--form", "shared-key", "--key-cache", str(budget)],
                     "CP": ["--form", "collaborative", "--rank", str(round(budget * width) - heads)]}
            for form, flags in forms.items():
                for fit, extra in (("weight-only", []), ("calibrated", ["--calibration", str(text)])):
                    out = Path(scratch) / f"{form}-{budget}-{fit}"
                    report, seconds = compress(model, out, *flags, *extra)
                    layers = report["layers"]
                    cache = sum(layer["cost_after"]["key_cache_per_token"] for layer in layers) / len(layers)
                    params = sum(layer["parameters_after"] for layer in layers)
                    ppl, kl = perplexity_and_kl(next_token_log_probabilities(out, evaluate), reference)
                    print(f"| {budget} | {form} | {fit} | {ppl:.2f} | {kl:.2e} | {cache:.1f} | {params:,} | "
                          f"{seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
