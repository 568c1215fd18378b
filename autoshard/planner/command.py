"""``autoshard plan``: the command line of the planner. Registered by ``autoshard.cli``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from autoshard.mesh import Mesh
from autoshard.planner import report
from autoshard.planner.config import DEFAULT_PRESET, PRESETS, Cluster, PlanError, TransformerConfig
from autoshard.planner.search import plan

NAME = "plan"
HELP = "choose dp, tp, pp and cp for a transformer on a cluster, and explain the choice"



def _preset_lines() -> str:
    lines = []
    for name, values in PRESETS.items():
        flags = [f"--{key.replace('_', '-')} {value}" for key, value in values.items()]
        lines += [f"  {name}: {' '.join(flags[:3])}", f"        {' '.join(flags[3:])}"]
    return "\n".join(lines)


_EPILOG = f"""\
cluster defaults come from --gpu (default {DEFAULT_PRESET}); any of them can be overridden:
{_preset_lines()}
Bandwidths are per GPU and per direction; the network bandwidth is one GPU's network card. Units: 80GB, 96GiB,
450GB/s, 400Gb/s (bits), 989TFLOPS, 5us. Compute reaches --efficiency of the peak; a plan may fill
--usable-memory of each GPU.

example (a 540B-parameter model on 4096 GPUs):
  autoshard plan --layers 118 --hidden 18432 --heads 144 --vocab 256000 --seq 2048 --global-batch 2048 \\
      --gpus 4096 --gpus-per-node 8 --gpu-memory 80GB
example (a HuggingFace model's config.json on 64 H200s):
  autoshard plan --config Meta-Llama-3-8B/config.json --seq 8192 --global-batch 512 --gpus 64 --gpu h200
example (a model's own compiled programs, costed from this machine's profile, as mesh="auto" costs them):
  autoshard calibrate --nproc 4 --out profile.json
  autoshard plan --profile profile.json --factory 'examples/model.py:build' --gpus 4 --memory-limit 8GiB
"""


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help=HELP, description=HELP, epilog=_EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    m = parser.add_argument_group("model (from --config or --model, or each flag; a flag overrides the file)")
    m.add_argument("--config", metavar="PATH", help="a HuggingFace config.json: fills every model flag but --seq "
                   "and --global-batch")
    m.add_argument("--model", metavar="DIR", help="a local HuggingFace model directory (its config.json)")
    for flag, what in (("--layers", "transformer blocks"), ("--hidden", "hidden size"),
                       ("--heads", "attention heads"), ("--vocab", "vocabulary size")):
        m.add_argument(flag, type=int, help=what)
    for flag, what in (("--seq", "sequence length in tokens"), ("--global-batch", "sequences per training step")):
        m.add_argument(flag, type=int, help=what + " (required but with --profile)")
    m.add_argument("--kv-heads", type=int, help="kv heads for grouped-query attention (default: --heads)")
    m.add_argument("--ffn", type=int, help="MLP hidden size, of each expert in a mixture (default: 4 * --hidden)")
    m.add_argument("--gated", action="store_true", default=None, help="SwiGLU-style MLP with three matrices")
    m.add_argument("--tied-embeddings", action="store_true", default=None,
                   help="the LM head shares the embedding's weights")
    m.add_argument("--experts", type=int, help="experts per layer of a mixture of experts (default 1: dense)")
    m.add_argument("--experts-per-token", type=int, help="experts each token is routed to (default 1)")
    m.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="training dtype (bf16)")
    c = parser.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, required=True, help="GPUs in the job (with --profile: its ranks)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink (8)")
    c.add_argument("--gpu", choices=sorted(PRESETS), default=DEFAULT_PRESET, help="defaults for the rest")
    for flag in ("--gpu-memory", "--intra-bandwidth", "--inter-bandwidth", "--intra-latency", "--inter-latency",
                 "--peak-flops"):
        c.add_argument(flag, metavar="QUANTITY", help="override the preset (e.g. 80GB, 450GB/s, 5us, 989TFLOPS)")
    c.add_argument("--efficiency", type=float, default=0.5, help="fraction of peak FLOP/s reached (0.5)")
    c.add_argument("--usable-memory", type=float, default=0.9, help="fraction of GPU memory a plan may fill (0.9)")
    p = parser.add_argument_group("plan")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="shard the Adam state over dp (ZeRO-1); by default every dp replica keeps it all")
    p.add_argument("--mesh", type=Mesh.parse, help="only this mesh, e.g. dp=32,tp=8,pp=16 (searches m, b, v)")
    p.add_argument("--top", type=int, default=5, help="splits to show (5)")
    p.add_argument("--formulas", action="store_true", help="print every formula of the cost model")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    g = parser.add_argument_group("from a measured profile: the model's compiled programs costed node by node")
    g.add_argument("--profile", metavar="JSON", help="a profile `autoshard calibrate` wrote on the machine to plan "
                   "for; needs --factory")
    g.add_argument("--factory", metavar="MODULE:FACTORY", help="the model, as `autoshard inspect` takes it: a "
                   "function returning (model, example_inputs, target, loss_fn)")
    g.add_argument("--memory-limit", metavar="QUANTITY", help="bytes each rank may hold (default: the profile's)")
    parser.set_defaults(run=run)
    return parser


def config_from(args: argparse.Namespace) -> TransformerConfig:
    given = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
             "seq": args.seq, "global_batch": args.global_batch, "kv_heads": args.kv_heads, "ffn": args.ffn,
             "gated": args.gated, "tied_embeddings": args.tied_embeddings, "experts": args.experts,
             "experts_per_token": args.experts_per_token, "dtype_bytes": 4 if args.dtype == "fp32" else 2}
    path = args.config or (args.model and os.path.join(args.model, "config.json"))
    if path:
        if args.config and args.model:
            raise PlanError("--config and --model both name a model: give one")
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read the model's config {path}: {e}") from e
        return TransformerConfig.from_hf(hf, **given)
    missing = [f"--{k.replace('_', '-')}" for k in ("seq", "global_batch") if given[k] is None]
    if missing:
        raise PlanError(f"the plan needs {' and '.join(missing)} (or --profile and --factory to plan a model's own "
                        "programs)")
    missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab") if given[k] is None]
    if missing:
        raise PlanError(f"the model needs {', '.join(missing)}, or --config config.json (or --model DIR) to read "
                        "them from")
    return TransformerConfig(**{k: v for k, v in given.items() if v is not None})


def cluster_from(args: argparse.Namespace) -> Cluster:
    overrides = {name: getattr(args, name) for name in ("gpu_memory", "intra_bandwidth", "inter_bandwidth",
                                                        "intra_latency", "inter_latency", "peak_flops")}
    return Cluster.preset(args.gpu, gpus=args.gpus, gpus_per_node=args.gpus_per_node, efficiency=args.efficiency,
                          usable_memory=args.usable_memory, **{k: v for k, v in overrides.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    """Plan and print; a PlanError (bad or impossible input) becomes one line on stderr and exit code 2."""
    if args.profile or args.factory:
        return _run_profiled(args)
    try:
        config, cluster = config_from(args), cluster_from(args)
        if args.top < 1:
            raise PlanError(f"--top {args.top}: show at least one split (--top 1)")
        result = plan(config, cluster, shard_optimizer=args.shard_optimizer, mesh=args.mesh)
        alternative = None
        if not args.shard_optimizer and args.mesh is None and result.best.split.dp > 1:
            alternative = plan(config, cluster, shard_optimizer=True)
    except ValueError as e:  # PlanError, UnitError and Mesh's errors: the input was the problem
        print(f"autoshard plan: error: {e}", file=sys.stderr)
        return 2
    data = report.build(result, top=args.top, alternative=alternative)
    print(json.dumps(data, indent=2) if args.json else report.format_text(data, formulas=args.formulas))
    return 0


def _run_profiled(args: argparse.Namespace) -> int:
    """``--profile`` and ``--factory``: the candidates ``mesh="auto"`` weighs, compiled and costed here, the fastest
    ``--top`` printed with their bytes per rank and why the winner wins."""
    from autoshard.explain import planner_ranking
    from autoshard.inspect_cli import InspectError, load_case
    from autoshard.options import CompileOptions
    from autoshard.planner.auto import measured_choice

    try:
        if not (args.profile and args.factory):
            raise PlanError("--profile and --factory go together: the profile costs the factory's model")
        if args.top < 1:
            raise PlanError(f"--top {args.top}: show at least one split (--top 1)")
        case = load_case(args.factory, batch=args.global_batch or 8, seq=args.seq or 16)
        if case.loss_fn is None:
            raise PlanError(f"{args.factory} returns no loss_fn and target, and the plan costs a training step: "
                            "return (model, example_inputs, target, loss_fn)")
        options = CompileOptions(planner_profile=args.profile, memory_limit=args.memory_limit)
        mesh, chosen, ranking = measured_choice(case.model, case.inputs, options, loss_fn=case.loss_fn,
                                                target=case.target, world_size=args.gpus)
    except (ValueError, InspectError, OSError) as e:
        print(f"autoshard plan: error: {e}", file=sys.stderr)
        return 2
    changed = {f.name: getattr(chosen, f.name) for f in dataclasses.fields(chosen)
               if f.name not in ("planner_profile", "memory_limit")
               and getattr(chosen, f.name) != getattr(CompileOptions(), f.name)}
    if args.json:
        print(json.dumps({"mesh": str(mesh), "options": {k: str(v) for k, v in changed.items()},
                          "ranking": [{"candidate": p.label(), "step_seconds": p.step, "parts": p.parts,
                                       "bytes_per_rank": p.memory.total if p.memory else None, "refused": p.error}
                                      for p in ranking[:args.top]]}, indent=2))
        return 0
    print("\n".join(planner_ranking(ranking, options, top=args.top)))
    said = ", ".join(f"{k}={v!r}" for k, v in changed.items())
    print(f"parallelize(model, {mesh}{', ' + said if said else ''})")
    return 0
