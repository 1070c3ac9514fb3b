"""``TrainConfig`` on the command line: one flag per field, with its help, default and type
(``add_train_arguments``, which ``geotrain run`` and ``geotrain train`` share), and back again
(``config_from_args``). The launcher-set flags are ``train.train_parser``'s.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from geotrain.api import LR_SCALE_DEFAULT
from geotrain.comm.guard import norm_ratio_arg
from geotrain.models import MODEL_SIZES
from geotrain.sync import ALGORITHMS
from geotrain.train_config import OPTIMIZERS, H_arg, TrainConfig, tau_arg, warmup_arg


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, with its default and type."""
    helps = {
        "algo": f"sync algorithm: {', '.join(ALGORITHMS)}",
        "model": f"the model: geotrain's GPT by size ({', '.join(MODEL_SIZES)}), or a Hugging Face "
        "causal LM: hf:DIR (saved with save_pretrained) or hf:TYPE (hf:gpt2, hf:llama: built from the "
        "type's config; needs the hf extra)",
        "model_config": "NAME=VALUE,... over the model's config, e.g. n_layer=2,n_embd=64 (GPT) or "
        "hidden_size=64,num_hidden_layers=2 (hf:llama)",
        "lora": "LoRA adapters (peft): r=8,alpha=16,targets=q_proj,v_proj[,dropout=0]; the base is "
        "frozen and only the adapters train and travel (targets default to the attention projections)",
        "lora_fa": "with --lora: freeze the A matrices too (LoRA-FA), halving what travels",
        "steps": "training steps per worker",
        "batch_size": "sequences per worker per step",
        "block_size": "tokens per sequence (0: the model's context)",
        "optimizer": f"the (inner) optimizer: {', '.join(OPTIMIZERS)}",
        "lr": "learning rate of the (inner) optimizer; 0: the algorithm's default (1e-3; demo, whose "
        "signed steps use it, 2e-3)",
        "weight_decay": "decoupled weight decay (adamw) or L2 (sgd)",
        "warmup": "steps of linear learning-rate warm-up; auto: a tenth of the planned steps (--lr-steps "
        "or --steps), at most 100 (demo: none); 0: none",
        "lr_schedule": "learning rate after the warm-up: constant, or cosine (decays to --min-lr-ratio "
        "x --lr at the last of --steps); the same for every algorithm",
        "min_lr_ratio": "cosine: the last step's learning rate as a fraction of --lr",
        "lr_steps": "the steps the schedule is planned over, if not --steps (a short run that "
        "follows the first part of a longer run's schedule)",
        "lr_scale": "sqrt: the optimizer steps each worker takes on its own gradient (localsgd, "
        "diloco, dreamddp, streaming, co2, sparseloco) run at sqrt(N) x the learning rate, so their "
        "average moves as far as a synchronous step at --lr where gradient noise dominates; auto: at "
        "the factor between 1 and sqrt(N) that the gradient noise measured at each sync calls for "
        "(localsgd, diloco, co2, sparseloco, dreamddp; 1 for the others); 1: at --lr "
        "(see docs/reaching-ddp-loss.md)",
        "H": "steps between synchronisations (localsgd, diloco, sparseloco, co2; of each fragment, "
        "streaming); the schedule's period (dreamddp; auto: the period with the shortest predicted time "
        "to a loss, chosen at start-up from the profile, up to one layer per iteration: see "
        "docs/dreamddp.md; sparseloco: of 5, 10, 20 and 40, the one with the shortest predicted time "
        "to a loss, from a step and an outer step's gather timed at start-up: see docs/frontier.md); "
        "0: the algorithm's default (10; dreamddp 2; sparseloco auto; co2 10; streaming 20)",
        "outer_lr": "the outer learning rate of diloco, streaming and co2 (0.7); 0: the algorithm's default",
        "outer_momentum": "the outer momentum: diloco's and streaming's Nesterov (-1: follows H: "
        "with --outer-lr 0.7, 0.5 up to H=10, rising to the paper's 0.9 at H=500; see "
        "docs/reaching-ddp-loss.md), "
        "co2's heavy-ball (-1: 0.5)",
        "momentum_ramp": "diloco, streaming (each fragment): where the outer momentum follows H, it rises "
        "linearly from that value at the first outer step to the paper's 0.9 over this many outer "
        "steps (-1 or 0: off, the H value throughout; 10 measured best on tiny); see "
        "docs/reaching-ddp-loss.md",
        "warm_start": "localsgd, diloco: the first W steps are synchronous SGD (gradients averaged "
        "every step, uncompressed), then periodic (post-local SGD); 0: periodic from the start",
        "H_schedule": "localsgd, diloco: shorter periods first, then H: grow (periods 2, 4, 8, ... below H, "
        "each for a tenth of the planned steps; grow:every=STEPS,start=P to choose) or PERIODxSTEPS,... "
        "(e.g. 2x50,5x100); each stage ends where both its period and the next divide the step count "
        "(see docs/reaching-ddp-loss.md); empty: H throughout",
        "site_H": "localsgd, diloco with --hierarchy sites or auto: the parameters are averaged inside "
        "each site (over its LAN) every site_H steps, and across sites every H; 0: off (the two levels "
        "then only split each all-reduce)",
        "pace": "localsgd, diloco: steps (every worker computes the H steps of a period) or time (a "
        "period lasts the fastest worker's H steps: a straggler computes the steps it can in that "
        "time and skips the rest, and the average weighs each worker by the steps it computed)",
        "chunk": "sparseloco: values per top-k chunk (default 4096); demo: DCT block per dimension (64)",
        "k": "values sent per chunk: sparseloco 64 of 4096 (1.56%%), demo 32 of 64x64",
        "bits": "bits per value sent: 2, 4 or 8 (default: sparseloco 2, demo 8); streaming 4, 8 or "
        "32 (default 4); co2 4 (default), 8 (gathered, with error feedback) or 32 (an fp32 all-reduce)",
        "beta": "sparseloco: error-feedback decay (0.95); demo: momentum decay (0.999); in [0, 1)",
        "alpha": "sparseloco: outer learning rate (default 1 over senders, 2 over workers: --mean-over)",
        "fragments": "streaming: fragments that synchronise in turn, one every H / fragments steps (4)",
        "tau": "streaming: steps a fragment's synchronisation overlaps, below H / fragments (1; 0: none; "
        "auto: the fewest that hide 1.5 times its gather, timed at start-up); "
        "sparseloco with overlap: steps into the next period at which an outer step's gather lands, 1 to H "
        "(0, the default: 1.5 times the first gather's length under --overlap auto, H under --overlap); "
        "co2: steps into the next period at which a period's mean lands, 1 to H (H: a period late, the "
        "paper's; auto, the default: the fewest that hide 1.5 times its exchange, timed at start-up)",
        "mix": "streaming: weight of the local parameters when a fragment's sync lands, in [0, 1], the "
        "paper's alpha (0.5; given, it turns --carry off)",
        "carry": "streaming (on by default; off with --mix or --tau 0): where a fragment's sync lands, "
        "it becomes the new global fragment plus the steps this worker took since its launch, in "
        "place of the paper's mix",
        "gap_penalty": "co2: the staleness gap penalty lambda >= 1 dividing the stale "
        "pseudo-gradient (1: none)",
        "clip": "co2: clamp the outer momentum element-wise to +-this (1.0; 0: off)",
        "eager": "co2 (on by default): each period starts from the anchor moved by this worker's own "
        "pseudo-gradient, standing in for the mean still in flight (eager updates, Kale et al. 2025)",
        "eager_weight": "co2 with --eager: the share of its own pseudo-gradient, in [0, 2], that moves "
        "a period's start (1: all of it, the default and the best measured)",
        "overlap": "sparseloco: each outer step lands later (--tau steps), its all-gather under "
        "the next steps' compute (--no-overlap: never; unset or --overlap auto: on where that reaches "
        "a loss sooner, the step it saves against the steps its later landing costs, from a gather "
        "timed at start-up with --H auto, else at the first outer step, and again on a timed synchronous "
        "step where its landing moves later than that pays for or its waits rise, which under --H auto "
        "may also move to a longer period); demo (on only with --overlap, "
        "auto is off: the loss suffers, see docs/frontier.md): each step's update lands one step late, its "
        "all-gather under the next step's compute",
        "mean_over": "sparseloco: each entry of the outer step is the mean over the workers that "
        "sent it (senders, the reference code's) or over every worker (workers); auto: senders "
        "without overlap or landing in the period's first half (--tau), workers landing later (each "
        "measured the better there; see docs/frontier.md)",
        "bucket_mb": "all-reduce bucket size in MB (0: the algorithm's default)",
        "compress": "a codec for the synchronisation messages, e.g. int8, int4, sign, topk:ratio=0.01, "
        "adatopk:ratio=0.01, powersgd:rank=4, acpsgd:rank=4, fp16, bf16 (ssgd, ddp, localsgd, diloco, "
        "dreamddp; empty: the algorithm's default: int4 for diloco, auto for dreamddp, uncompressed "
        "for the others; none: uncompressed); auto (dreamddp's default): its planner chooses fp32, "
        "int8, int4 or chunktopk with the schedule, by predicted time to a loss",
        "plan": "dreamddp: a plan JSON from `geotrain plan` (empty: profile and plan at start-up)",
        "fill_in": "dreamddp (off by default: no loss gained, 5-10%% of the step lost on W1): each "
        "iteration also averages the layers whose all-reduce fits in the link's idle time, beyond "
        "the period's schedule",
        "lag": "dreamddp: where a layer's average lands: 0 (the paper's: before this step's update) "
        "or 1 (the default uncompressed: at the layer's next forward, its all-reduce running on "
        "under the update and the forward below it; a period's last iteration lands at once); with "
        "a codec (the one --compress auto chooses included) 0 by default (at 1 the codec's second "
        "phase runs under the update and the forward, measured slower on CPU workers)",
        "replan_threshold": "dreamddp: re-profile and re-plan when step time drifts this fraction, "
        "and fit the link's slowdown under backward once (0: never re-plan, no fit)",
        "eval_every": "validation every K steps (0: only at the end)",
        "eval_batches": "validation batches per evaluation (the same on every worker)",
        "eval_model": "what a validation during the run scores: average (the mean of the replicas, "
        "the model the run would end with if stopped there: one all-reduce of the trained parameters "
        "per validation where the replicas differ, counted as control traffic, not in a step's bytes "
        "or time), replicas (each replica's own loss, averaged: no traffic), auto (average on "
        "loopback, replicas on shaped or real links)",
        "seed": "seed of the model and of each worker's data stream",
        "data": "a folder of text files or a uint16 .bin file (empty: Python's standard library sources); "
        "with --tokenizer: .txt, .jsonl (a 'text' field) or .parquet files, or a folder of them",
        "tokenizer": "a tokenizers JSON file, or a directory with tokenizer.json (a Hugging Face model's): "
        "--data is tokenized with it once, cached next to the data (empty: bytes, vocabulary 256)",
        "threads": "torch threads per worker (0: cores / workers on this machine)",
        "backend": "the process group's: nccl (CUDA tensors; gloo carries the CPU control numbers), "
        "gloo (CPU or CUDA tensors), auto (nccl where every worker on a machine has a GPU of its own, "
        "gloo otherwise: NCCL refuses two ranks on one GPU)",
        "autocast": "bf16: forward passes (training, profiling, validation) under torch.autocast in "
        "bfloat16 on the worker's device; parameters, gradients and what is averaged stay fp32 (off: fp32)",
        "timeout_s": "seconds a collective (and a membership rendezvous) may wait for the other workers "
        "before the run fails (0: twice what the slowest link, --link-rate, needs for three copies of "
        "the model, plus a minute, at least 600)",
        "sites": "the site of each host, e.g. 0,0,1,1 (geotrain run --topology sets it): with "
        "--hierarchy sites, all-reduces sum inside each site first and all-gathers carry each message "
        "across once",
        "hierarchy": "off; sites: every all-reduce in two levels (inside each site over its LAN, "
        "across sites in stripes carried by every member, then shared inside), and every all-gather "
        "where sites are of equal size (each message carried across by its own host, then shared "
        "inside), so less crosses the "
        "slow links between sites (see docs/sites.md); auto: the same, with the sites found by "
        "measuring each pair of hosts' link at start-up",
        "slow": "stragglers: HOST:FACTOR, ';'-separated (e.g. 1:3): that host computes FACTOR times "
        "slower (after each optimizer step it sleeps FACTOR - 1 times its compute: three times its "
        "forward's time, for forward and backward, plus the optimizer step's; on CPU with one "
        "thread, timed on its thread's CPU clock, so other processes on its core do not count)",
        "max_rejections": "with --on-failure continue (the default): a host whose contributions were "
        "rejected this many times in a row is dropped from the run (0: never; use with 3 or more workers)",
        "max_norm_ratio": "leave out of every average (gradients, pseudo-gradients, parameters) a worker's "
        "contribution that is not finite or whose norm is more than R times the others' median; "
        "inf: only what is not finite; 0: off; auto (the default): 10 for localsgd, diloco, co2, "
        "streaming, sparseloco and demo (a round trip per sync, or none), inf among 2 workers; off "
        "for the per-step averages (ssgd, ddp, dreamddp, a --warm-start: one step's gradients vary "
        "too much for a ratio) and --pace time (see docs/trust.md: what it covers)",
        "aggregate": "mean; clip: every contribution to an average is also scaled down to the "
        "median norm where above it (no extra communication); trimmed:f=F: the coordinate-wise mean "
        "without each coordinate's F largest and F smallest values; median: the coordinate-wise "
        "median (these two all-gather every contribution: N/2 times an all-reduce's bytes); "
        "non-finite contributions are always left out",
        "link_rate": "the slowest host's link, e.g. 10mbit, for the collective timeout (geotrain run sets it "
        "from --bandwidth)",
        "progress": "show a progress bar on rank 0",
        "resume": "continue the run in --run-dir from its newest snapshot every worker can reach",
        "resume_step": "with --resume: restore this snapshot step instead of the newest",
        "snapshot_every": "steps between in-memory snapshots (0: a periodic "
        "method's first sync boundary at least 50 steps on, every 50 steps otherwise)",
        "checkpoint_every": "steps between disk checkpoints, written by the keeper from its copy "
        "(0: only at the end)",
        "redundancy": "who else holds each worker's unique state: off, ring (the next worker's "
        "keeper), ec:K/N (N erasure-coded stripes on N peers, any K rebuild it)",
        "snapshot_bandwidth": "pace of redundancy traffic, e.g. 5mbit (0: as fast as the link goes)",
        "keeper": "this host's keeper socket (`geotrain keeper --socket PATH`); empty: none",
        "token_file": "a file holding the run's secret (else $GEOTRAIN_TOKEN): this worker proves it "
        "holds it before it is let in (geotrain run makes one per run; see docs/trust.md)",
        "chaos": "fault injection, ';'-separated: kill:step=S,rank=R | kill-host:step=S,host=H | "
        "kill:every=60s, each with optional ,restart=SECONDS; corrupt:step=S|every=K,rank=R"
        "[,kind=nan|inf|signflip][,scale=X][,part=shard|stamp]: that worker's next contribution to "
        "an average is spoiled (part=shard: its shard of a quantised codec's mean; part=stamp: its "
        "copies of shards go out under a false owners' stamp, with owners=2; see docs/trust.md)",
    }
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        launcher_set = (
            "link", "network_mode", "run_dir", "latency_ms", "profile_out", "profile_codecs", "resume",
            "keeper", "elastic",
            "fault_timeout_s", "join", "spare", "min_workers", "join_timeout",
        )  # fmt: skip
        if f.name in (*launcher_set, "heartbeat", "broker", "host"):
            continue  # set by the launcher or added by the caller
        if f.name == "overlap":  # --overlap, --no-overlap, or --overlap auto (unset: the same)
            parser.add_argument(
                flag, nargs="?", const=True, default=f.default, type=_auto_is_none, dest=f.name,
                metavar="auto", help=helps.get(f.name),
            )  # fmt: skip
            parser.add_argument("--no-overlap", action="store_false", dest=f.name, help=argparse.SUPPRESS)
        elif f.type in ("bool", bool, "bool | None"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=helps.get(f.name)
            )
        else:
            typ = {"int": int, "float": float, "str": str}[str(f.type)]
            typ = norm_ratio_arg if f.name == "max_norm_ratio" else typ  # a number or "auto"
            typ = warmup_arg if f.name == "warmup" else typ  # a number or "auto"
            typ = H_arg if f.name == "H" else typ
            typ = tau_arg if f.name == "tau" else typ
            typ = _lr_scale_arg if f.name == "lr_scale" else typ
            default = "auto" if f.name == "warmup" else f.default  # argparse runs it through typ
            default = LR_SCALE_SHOWN if f.name == "lr_scale" else default
            parser.add_argument(flag, type=typ, default=default, help=helps.get(f.name), dest=f.name)


# What --help says --lr-scale is when left out ("": each algorithm's own default).
LR_SCALE_SHOWN = "the algorithm's own: 1 for every algorithm today"


def _lr_scale_arg(text: str) -> str:
    return LR_SCALE_DEFAULT if text == LR_SCALE_SHOWN else text


def _auto_is_none(text: str) -> None:
    """The value ``--overlap`` may take: ``auto``, which is what leaving it out means."""
    if text != "auto":
        raise argparse.ArgumentTypeError(f"takes no value (on), or 'auto'; --no-overlap is off; got {text!r}")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
