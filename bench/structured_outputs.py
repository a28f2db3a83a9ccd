"""The cost of structured outputs in the engine (docs/structured-outputs.md).

    python bench/structured_outputs.py [--rounds 3] [--threads 1] [--backend guidance|xgrammar]

On the shared 56 M Llama with the demo's WordPiece tokenizer (``_peers_checkpoint.py``
``text_words_checkpoint``: random weights, so every valid output is the grammar's doing),
offline ``LLM``, one torch thread:

- Throughput: output tok/s of requests with a JSON schema against the same requests
  unconstrained, greedy, at concurrency 1 (one request at a time) and 64 (one batch of
  64). The systems alternate round by round; each one's best round is reported, and
  the ratio of the two best. Unconstrained requests run to the lengths the constrained
  ones reached (``ignore_eos``): the same tokens in the same batch shapes, so only the
  grammar's cost differs. Goal (issue 30): at most 5 % slower at 64, 10 % at 1.
- Time to the first mask of a new schema: compile it for the tokenizer, make the
  matcher, compute its first mask; p50 / p99 over 200 distinct schemas (goal: p50 <=
  5 ms), then over the same 200 again with the compiled-grammar cache warm.
- Valid outputs: the share of constrained outputs that parse and fit the schema.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers_checkpoint import text_words_checkpoint  # noqa: E402

from services import LLM, SamplingParams  # noqa: E402
from services.stats import percentile  # noqa: E402
from services.structured.matcher import apply_masks, forbidden_tokens  # noqa: E402
from services.structured.outputs import StructuredOutputs  # noqa: E402

CACHE = Path.home() / ".cache" / "epd-serve" / "peers"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "active": {"type": "boolean"},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["id", "name", "active", "score", "color", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 96


def fits(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    props = SCHEMA["properties"]
    return (
        isinstance(doc, dict)
        and set(doc) == set(props)
        and type(doc["id"]) is int
        and len(doc["name"]) <= 24
        and type(doc["active"]) is bool
        and doc["color"] in props["color"]["enum"]
        and len(doc["tags"]) <= 3
    )


def document(llm: LLM, out) -> str:
    """The output's text without its end token (this checkpoint's EOS, id 2, is an
    ordinary WordPiece entry, `[unused1]`, so it is printed)."""
    eos = llm.tokenizer.convert_ids_to_tokens(llm.engine.eos_token_ids[0])
    return out.text.removesuffix(eos).strip()


def run(llm: LLM, prompts: list[str], batch: int, lengths: list[int] | None):
    """(seconds, output lengths, valid outputs) of ``prompts``, ``batch`` at a time:
    under the schema when ``lengths`` is None, else free, each to its given length."""
    if lengths is None:
        so = {"json": SCHEMA}
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so)]
        params *= len(prompts)
    else:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    got, valid = [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i : i + batch], params[i : i + batch]):
            got.append(len(out.outputs[0].token_ids))
            valid += fits(document(llm, out.outputs[0]))
    return time.perf_counter() - start, got, valid


def throughput(llm: LLM, rounds: int) -> dict:
    """Free requests run to the very lengths the constrained ones reached, so both make
    the same tokens in the same batch shapes and only the grammar's cost differs."""
    cases = {"c1": (8, 1), "c64": (64, 64)}  # (requests, concurrency)
    result = {}
    for name, (n, batch) in cases.items():
        prompts = [f"record {i}: describe item {i * 7} as json" for i in range(n)]
        best = {"json": 0.0, "plain": 0.0}
        valid = 0
        for _ in range(rounds):
            secs, lengths, valid = run(llm, prompts, batch, None)
            best["json"] = max(best["json"], sum(lengths) / secs)
            secs, _, _ = run(llm, prompts, batch, lengths)
            best["plain"] = max(best["plain"], sum(lengths) / secs)
        result[name] = {
            "requests": n,
            "output_tokens": sum(lengths),
            "plain_tok_s": round(best["plain"], 1),
            "json_tok_s": round(best["json"], 1),
            "json_vs_plain": round(best["json"] / best["plain"], 3),
            "valid": f"{valid}/{n}",
        }
        print(name, result[name], flush=True)
    return result


def first_mask(llm: LLM, n: int = 200) -> dict:
    """Compile, matcher, first mask: for ``n`` new schemas, then for the same again (the
    compiled-grammar cache warm)."""
    grammars = llm.engine.grammars
    vocab = llm.engine.loaded.text_config.vocab_size
    assert grammars.ll is not None  # the tokenizer's table: once per model, not per request
    schemas = []
    for i in range(n):
        schema = dict(SCHEMA, properties={f"{k}_{i}": v for k, v in SCHEMA["properties"].items()})
        schemas.append(StructuredOutputs(json={**schema, "required": list(schema["properties"])}))
    out = {}
    for name in ("new", "warm"):
        times = []
        for constraint in schemas:
            start = time.perf_counter()
            matcher = grammars.matcher(constraint, [])
            apply_masks(torch.zeros(1, vocab), [0], forbidden_tokens([matcher]))
            times.append((time.perf_counter() - start) * 1e3)
        out[name] = {
            "p50_ms": round(percentile(times, 50), 2),
            "p99_ms": round(percentile(times, 99), 2),
        }
    print("first mask", out, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", default="guidance", choices=("guidance", "xgrammar"))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(
        str(text_words_checkpoint(CACHE)),
        num_kv_blocks=2048,
        block_size=16,
        structured_outputs_backend=args.backend,
    )
    doc = {
        "bench": "structured_outputs",
        "backend": args.backend,
        "threads": args.threads,
        "throughput": throughput(llm, args.rounds),
        "first_mask": first_mask(llm),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
