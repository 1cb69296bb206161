"""The on-policy answers as a compact, committed archive, so a long `make eagle3` run resumes on
another machine: generating 1.5M answer tokens takes hours on these CPUs, and var/ does not travel.

The archive keeps what cannot be recomputed cheaply: per finished shard, each sample's trace id,
workload and the target's answer tokens. Prompts are not stored: they are rendered again from the
bundled traces (eagle3_training.corpus), and the archive's settings, the same `settings.json` the
generator checks (model, dtype, max_new_tokens, shard size, digest of the prompts), must match the
run's before any shard is restored. An archive from other prompts or settings is refused, naming what
differs; restoring never overwrites a shard that is already there.
"""
from __future__ import annotations

import json
import lzma
import os
from collections.abc import Sequence
from pathlib import Path

from eagle3_training.corpus import Prompt
from eagle3_training.generate import Sample, write_shard, read_samples, shard_path

FORMAT = "hvd-eagle3-answers/1"


class ArchiveError(ValueError):
    """An answers archive that is unreadable or was made from other prompts or settings."""


def pack(folders: dict[str, Path], out: Path) -> dict[str, int]:
    """Write every finished shard of each generator folder (name -> folder) to one xz archive;
    returns the answer tokens per folder."""
    tokens: dict[str, int] = {}
    tmp = out.with_suffix(out.suffix + ".tmp")
    with lzma.open(tmp, "wt", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(json.dumps({"format": FORMAT}) + "\n")
        for name, folder in folders.items():
            settings = json.loads((folder / "settings.json").read_text())
            shards = sorted(folder.glob("shard-*.jsonl"))
            f.write(json.dumps({"folder": name, "settings": settings, "shards": len(shards)}) + "\n")
            count = 0
            for path in shards:
                samples = read_samples_file(path)
                count += sum(len(s.output_ids) for s in samples)
                f.write(json.dumps({"shard": int(path.stem.split("-")[1]),
                                    "samples": [[s.trace_id, s.workload, list(s.output_ids)] for s in samples]},
                                   separators=(",", ":")) + "\n")
            tokens[name] = count
    os.replace(tmp, out)
    return tokens


def read_samples_file(path: Path) -> list[Sample]:
    return read_samples(path.parent, [path])


def restore(archive: Path, name: str, folder: Path, prompts: Sequence[Prompt], settings: dict,
            log=print) -> int:
    """Materialise the archive's shards of generator folder `name` into `folder` for a run whose
    prompts and settings are given; returns how many shards were restored (0 if the archive has none
    for it, or has them for other settings: a run of another configuration generates its own, and
    the log says why). Shards already in the folder are left as they are."""
    try:
        with lzma.open(archive, "rt") as f:
            header = json.loads(f.readline())
            if header.get("format") != FORMAT:
                raise ArchiveError(f"{archive}: format {header.get('format')!r}, expected {FORMAT!r}")
            restored, current = 0, None
            for n, line in enumerate(f, 2):
                d = json.loads(line)
                if "folder" in d:
                    current = d["folder"]
                    if current == name and d["settings"] != settings:
                        changed = sorted(k for k in settings if d["settings"].get(k) != settings.get(k))
                        log(f"{archive}: its {name} answers were generated with other settings "
                            f"({', '.join(changed)} differ); not restored")
                        return 0
                    continue
                if current != name:
                    continue
                restored += _restore_shard(archive, n, d, folder, prompts, int(settings["shard_prompts"]))
    except (OSError, EOFError, lzma.LZMAError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ArchiveError(f"{archive}: not a readable answers archive ({exc})") from exc
    if restored:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "settings.json"
        if not path.is_file():
            path.write_text(json.dumps(settings, indent=1) + "\n")
    return restored


def _restore_shard(archive: Path, line: int, d: dict, folder: Path, prompts: Sequence[Prompt],
                   shard_prompts: int) -> int:
    """Shards are fixed slices of the prompt list: shard i answers prompts[i * shard_prompts :][:shard_prompts]."""
    index = int(d["shard"])
    path = shard_path(folder, index)
    if path.exists():
        return 0
    size = len(d["samples"])
    chunk = prompts[index * shard_prompts : index * shard_prompts + shard_prompts]
    samples = []
    for prompt, (trace_id, workload, output_ids) in zip(chunk, d["samples"]):
        if prompt.trace_id != trace_id:
            raise ArchiveError(f"{archive}:{line}: shard {index} holds {trace_id!r} where this run's prompt "
                               f"order has {prompt.trace_id!r}")
        samples.append(Sample(trace_id, workload, prompt.token_ids, tuple(int(t) for t in output_ids)))
    if len(samples) != size:
        raise ArchiveError(f"{archive}:{line}: shard {index} has {size} samples, this run has {len(chunk)} prompts")
    folder.mkdir(parents=True, exist_ok=True)
    write_shard(path, samples)
    return 1


def main(argv: list[str] | None = None) -> None:
    import argparse

    from eagle3_training.pipeline import REPO_ROOT, PipelineConfig

    d = PipelineConfig()
    p = argparse.ArgumentParser(description="pack the finished answer shards of `make eagle3` into the committed archive")
    p.add_argument("--work", type=Path, default=d.work)
    p.add_argument("--out", type=Path, default=d.answers)
    a = p.parse_args(argv)
    folders = {name: a.work / name for name in ("samples", "samples-fp32", "held_out") if (a.work / name / "settings.json").is_file()}
    if not folders:
        p.error(f"no generated answers under {a.work} (run make eagle3 first)")
    tokens = pack(folders, a.out)
    print(f"{a.out.relative_to(REPO_ROOT) if a.out.is_relative_to(REPO_ROOT) else a.out}: "
          + ", ".join(f"{name} {n:,} answer tokens" for name, n in tokens.items())
          + f"; {a.out.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
