"""Schema coverage of structured outputs: the share of real-world JSON schemas that
compile for our grammar engine and yield valid output (docs/structured-outputs.md).

    python bench/schema_coverage.py [--limit N] [--max-tokens 480] [--json out.json]

The set is one no one here wrote: the schemas vendored in the PyPI package
``check-jsonschema`` (``pip install check-jsonschema==0.39.0``), from
``check_jsonschema/builtin_schemas/vendor/*.json``. Each schema is

- refused by bound: over ``MAX_SCHEMA_BYTES`` or nested deeper than ``MAX_SCHEMA_DEPTH``
  (``StructuredOutputs`` refuses it by design, before llguidance sees it);
- a compile failure: ``GrammarSet.check`` raises (the first line of its reason is listed);
- compiled: its time to first mask is measured (compile, matcher, first mask: what a new
  schema costs a request, median of 3), and it gets one greedy output and one seeded
  sample (T = 1) from a tiny random-weight model with a byte-level BPE tokenizer
  (``make_byte_bpe_checkpoint``: any text can be written, so a valid output is the
  grammar's doing), all in one ``LLM.generate`` batch.

An output is valid when ``json.loads`` reads it and ``jsonschema`` (the validator for the
schema's ``$schema`` draft, ``format`` as annotation, the spec's default) accepts it;
an output cut by ``max_tokens`` (or by the checkpoint's 512 positions) counts as length,
apart: a random model can wander in a big schema.

``--lenient`` is a what-if: each schema carries ``"x-guidance": {"lenient": true}``, as a
client may send it today, so llguidance ignores the keywords it cannot enforce
(``uniqueItems``, ``not``, ``if``/``then``, ...) and approximates ``oneOf`` by ``anyOf``:
more schemas compile, and the validator says what that costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.helpers
from services import LLM, SamplingParams  # noqa: E402
from services.stats import percentile  # noqa: E402
from services.structured.matcher import forbidden_tokens  # noqa: E402
from services.structured.outputs import StructuredOutputs  # noqa: E402
from tests.helpers.checkpoints import make_byte_bpe_checkpoint  # noqa: E402

CACHE = Path.home() / ".cache" / "epd-serve" / "schema-coverage"
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "seed": 0}}


def vendored_schemas(limit: int | None) -> dict[str, dict]:
    """name -> schema, sorted by name, of check-jsonschema's vendored schemas."""
    import check_jsonschema

    vendor = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
    files = sorted(vendor.glob("*.json"))[:limit]
    return {f.stem: json.loads(f.read_text()) for f in files}


def sort_out(llm: LLM, schemas: dict[str, dict], lenient: bool) -> dict:
    """Each schema into ``compiled`` (name -> StructuredOutputs), ``bound`` or
    ``failed`` (name -> the first line of the reason)."""
    out = {"compiled": {}, "bound": {}, "failed": {}}
    for name, schema in schemas.items():
        if lenient:
            schema = {**schema, "x-guidance": {"lenient": True}}
        try:
            so = StructuredOutputs(json=schema)
        except ValueError as e:
            size = len(json.dumps(schema).encode())
            out["bound"][name] = f"{e} ({size} bytes)"
            continue
        try:
            llm.engine.grammars.check(so)
        except ValueError as e:
            out["failed"][name] = str(e).splitlines()[0]
            continue
        out["compiled"][name] = so
    return out


def first_mask_ms(llm: LLM, so: StructuredOutputs, repeats: int = 3) -> float:
    """Median ms from a new schema to its first mask (compile, matcher, mask)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forbidden_tokens([llm.engine.grammars.matcher(so, [])])
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def generate(llm: LLM, compiled: dict[str, StructuredOutputs], max_tokens: int) -> list:
    """(name, mode, output) of every compiled schema in every mode, in one batch."""
    cases = [(name, mode) for mode in MODES for name in compiled]
    prompts = [f"Write a {name} file as JSON.\n" for name, _ in cases]
    params = [
        SamplingParams(max_tokens=max_tokens, structured_outputs=compiled[name], **MODES[mode])
        for name, mode in cases
    ]
    outs = llm.generate(prompts, params)
    return [(name, mode, out.outputs[0]) for (name, mode), out in zip(cases, outs, strict=True)]


def judge(schema: dict, text: str) -> tuple[str, str]:
    """("valid" | "invalid", why) of one finished output."""
    from jsonschema import validators
    from jsonschema.exceptions import best_match

    try:
        doc = json.loads(text)
    except ValueError as e:
        return "invalid", f"not JSON: {e}"
    try:
        error = best_match(validators.validator_for(schema)(schema).iter_errors(doc))
    except Exception as e:  # the validator itself failed (a ref, a pattern it cannot read)
        return "invalid", f"validator error: {type(e).__name__}: {e}"
    if error is None:
        return "valid", ""
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return "invalid", f"at {where}: {error.message}"[:300]


def judged(schemas: dict[str, dict], outputs: list) -> dict[str, dict]:
    """mode -> {"valid" | "invalid" | "length": {name: why}}."""
    result = {mode: {"valid": {}, "invalid": {}, "length": {}} for mode in MODES}
    for name, mode, out in outputs:
        if out.finish_reason == "length":
            tail = out.text[-40:]
            result[mode]["length"][name] = f"{len(out.token_ids)} tokens, ends {tail!r}"
            continue
        verdict, why = judge(schemas[name], out.text)
        result[mode][verdict][name] = why
    return result


def table(rows: list[tuple]) -> str:
    """A markdown table; the first row is the header."""
    lines = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    lines.insert(1, "|" + "---|" * len(rows[0]))
    return "\n".join(lines)


def report(title: str, n: int, sorted_: dict, verdicts: dict, masks: list, max_tokens: int) -> str:
    """The tables and the failure lists, as markdown."""
    compiled = len(sorted_["compiled"])
    head = ("schemas", "compiled", "refused by bound", "compile failures")
    counts = (n, compiled, len(sorted_["bound"]), len(sorted_["failed"]))
    parts = [title, table([head, counts])]
    rows = [("decoding", "outputs", "valid", "invalid", f"length (max_tokens {max_tokens})")]
    for mode, v in verdicts.items():
        rows.append((mode, compiled, len(v["valid"]), len(v["invalid"]), len(v["length"])))
    parts.append(table(rows))
    if masks:
        p50, p99 = percentile(masks, 50), percentile(masks, 99)
        parts.append(f"time to first mask of a compiled schema: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    lists = [("Refused by bound", sorted_["bound"]), ("Compile failures", sorted_["failed"])]
    for mode, v in verdicts.items():
        lists += [(f"Invalid ({mode})", v["invalid"]), (f"Length ({mode})", v["length"])]
    for title, items in lists:
        if items:
            parts.append(f"{title}:\n" + "\n".join(f"- {k}: {why}" for k, why in items.items()))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, help="try only the first N schemas (by name)")
    # The checkpoint holds 512 positions, prompt included: 480 leaves the prompt room.
    ap.add_argument("--max-tokens", type=int, default=480)
    ap.add_argument("--lenient", action="store_true", help="what-if: x-guidance lenient")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    schemas = vendored_schemas(args.limit)
    ckpt = make_byte_bpe_checkpoint(CACHE)
    llm = LLM(str(ckpt), num_kv_blocks=4096, block_size=16)
    sorted_ = sort_out(llm, schemas, args.lenient)
    masks = [first_mask_ms(llm, so) for so in sorted_["compiled"].values()]
    outputs = generate(llm, sorted_["compiled"], args.max_tokens) if sorted_["compiled"] else []
    verdicts = judged(schemas, outputs)
    source = f"check-jsonschema {version('check-jsonschema')} vendored schemas"
    title = source + (", lenient (what-if)" if args.lenient else "")
    print(report(title, len(schemas), sorted_, verdicts, masks, args.max_tokens), flush=True)
    if args.json:
        doc = {
            "bench": "schema_coverage",
            "source": source,
            "lenient": args.lenient,
            "max_tokens": args.max_tokens,
            "schemas": len(schemas),
            "compiled": sorted(sorted_["compiled"]),
            "refused_by_bound": sorted_["bound"],
            "compile_failures": sorted_["failed"],
            "outputs": verdicts,
            "first_mask_ms": {"p50": percentile(masks, 50), "p99": percentile(masks, 99)},
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
